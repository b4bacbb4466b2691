"""One configuration of benchmarks/e2e_throughput.py compiled and profiled in this process,
so that the profiled kernel names match the Inductor code logged with TORCH_LOGS=output_code:

    TORCH_LOGS=output_code python3 benchmarks/kernel_code.py dar_block [TOP] 2> code.txt

prints the kernel time per category and the TOP (default 12) largest kernels, ms per step;
``benchmarks/kernel_inputs.py`` joins them with the code.
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import e2e_throughput as e2e  # noqa: E402

name = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
model, compiled = e2e._build(name)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, model.config.vocab_size, (e2e.BATCH, e2e.SEQ), device="cuda")


def step():
    opt.zero_grad(set_to_none=True)
    compiled(x, x)[1].backward()
    opt.step()


for _ in range(3):
    step()
out = e2e.kernel_breakdown(step, 2, top, name_chars=None)  # whole names: kernel_inputs.py joins on them
print(out["categories"])
for t in out["top"]:
    print(f"{t['ms']:8.2f} {t['calls']:4d} {t['kernel']}")
