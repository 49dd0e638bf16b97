"""Small cases run under compute-sanitizer memcheck on the GPU: corrupt slots and tables must not
cause any out-of-bounds access."""
import torch

import pagedattn
from pagedattn import CacheSpec

for layout in ("NHD", "HND"):
    for kv, dtype in (("auto", torch.bfloat16), ("fp8_e4m3", torch.uint8)):
        spec = CacheSpec(4, 16, 4, 72, dtype, kv, layout, "head" if layout == "HND" else "tensor")
        kc, vc = spec.allocate("cuda", fill=float("nan"))
        flat = torch.randn(2 * 9 * 4 * 72 + 1, dtype=torch.bfloat16, device="cuda")
        key = flat[1:1 + 9 * 4 * 72].view(9, 4, 72)           # unaligned base
        slots = torch.tensor([0, -1, 63, 64, 2**40, -2**40, 5, 17, 3], device="cuda")
        s = torch.ones(4 if spec.scale == "head" else 1, device="cuda")
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots, kv, s, s)
torch.cuda.synchronize()
print("sanitize cases done")
