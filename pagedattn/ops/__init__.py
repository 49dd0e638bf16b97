from . import kv_write  # noqa: F401  (registers the family)
