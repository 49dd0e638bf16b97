from . import kv_write  # noqa: F401  (registers the family)
from . import legacy_cache  # noqa: F401  (registers the family)
from . import legacy_attention  # noqa: F401  (registers the families)
from . import attention  # noqa: F401  (registers attn_fwd)
