"""The largest error of each tensor-parallel run of tests/e2e/test_tensor_parallel.py against
one process, relative to each tensor's largest element (float64, gloo ranks on the CPU):
the figures behind the test's tolerances (docs/benchmarks.md, sessions 63-64).

    python benchmarks/tensor_parallel_errors.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.conftest import free_port  # noqa: E402
import tests.e2e.test_tensor_parallel as tp  # noqa: E402


def main(out_dir: str) -> None:
    runs = os.path.join(out_dir, "tp.pt")
    mp.spawn(tp._tp_worker, args=(free_port(), runs), nprocs=tp.WORLD, join=True)
    found = torch.load(runs)
    print("| run | gradients | parameters after the steps | loss, relative |")
    print("| --- | ---: | ---: | ---: |")
    for (scheme, compiled), (loss, grads) in found["as_is"].items():
        want_loss, want = tp._gradients(*tp._model(scheme))
        print(f"| plain TP as it is: {scheme}{' compiled' if compiled else ''} | "
              f"{tp._largest_relative_error(grads, want):.2g} | | {abs(loss - want_loss) / abs(want_loss):.1g} |")
    for (scheme, sequence_parallel, how), (losses, grads, params) in found["declared"].items():
        want_losses, want_grads, want_params = tp._train(*tp._model(scheme), all_dtensors=sequence_parallel)
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        print(f"| sequence_parallel={sequence_parallel}: {scheme} {how or 'eager'} | "
              f"{tp._largest_relative_error(grads, want_grads):.2g} | "
              f"{tp._largest_relative_error(params, want_params):.2g} | {loss_error:.1g} |")
    _, want = tp._gradients(*tp._model("block_attnres"))
    for name in ("check_no_sequence_parallel", "first_block_stream"):
        _, grads = found["without", name]
        print(f"| sequence parallel without {name} | {tp._largest_relative_error(grads, want):.3g} | | |")
    runs = os.path.join(out_dir, "fsdp_tp.pt")
    mp.spawn(tp._fsdp_tp_worker, args=(free_port(), runs), nprocs=2 * tp.WORLD, join=True)
    found = torch.load(runs)
    for scheme, how, layout in tp.FSDP_TP_RUNS:
        _, want = tp._gradients(*tp._model(scheme))
        print(f"| {layout} x sequence parallel: {scheme} {how or 'eager'} | "
              f"{tp._largest_relative_error(found[scheme, how, layout], want):.2g} | | |")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
