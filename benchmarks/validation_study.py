"""The validation study of the training issue, on the GPU(s) of one machine, in one call.

    python benchmarks/validation_study.py --data-dir DIR --out OUT [--steps 600] [--workers-per-gpu 6]

Grid: corpora (tinyshakespeare, tinystories_sample, text8_prefix) x the bundled GPT at 12
and 24 layers x schemes (residual, attnres, block_attnres, mhar, wav, dar), plus the MoE
with residual, block_attnres and dar, plus extra seeds for the 12-layer GPT on
tinyshakespeare. Every run has the same budget (steps, batch, sequence, learning-rate
schedule) and the same data seed. Runs are spread over all visible GPUs, several
processes per GPU (these models are small: one process does not fill an H200). Writes
``OUT/study.json`` (one record per run: config, train curve, validation curve, final
validation loss, tokens/s) and prints a table last. ``docs/validation.md`` is written from
that file by ``benchmarks/validation_report.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import time
import traceback

CORPORA = ("tinyshakespeare.txt", "tinystories_sample.txt", "text8_prefix.txt")
SCHEMES = {
    "residual": {},
    "attnres": {},
    "block_attnres": {},
    "mhar": {},
    "wav": {},
    "dar": {"layers_per_block": 2},
}
MOE_SCHEMES = ("residual", "block_attnres", "dar")


def grid(args) -> list[dict]:
    jobs = []
    for corpus in CORPORA:
        for layers in args.layers:
            for scheme in SCHEMES:
                jobs.append(dict(model="gpt:small", layers=layers, scheme=scheme, corpus=corpus, seed=0))
        for scheme in MOE_SCHEMES:
            jobs.append(dict(model="moe:small", layers=8, scheme=scheme, corpus=corpus, seed=0))
    for seed in range(1, args.extra_seeds + 1):
        for scheme in SCHEMES:
            jobs.append(dict(model="gpt:small", layers=12, scheme=scheme, corpus=CORPORA[0], seed=seed))
    for layers in args.deep_layers:  # the depth claims (WAV), on the first corpus only
        for scheme in args.deep_schemes:
            jobs.append(dict(model="gpt:small", layers=layers, scheme=scheme, corpus=CORPORA[0], seed=0))
    if args.skip_done:  # a study continued in a second call: leave out the runs already made
        done = {_key(r) for r in json.loads(pathlib.Path(args.skip_done).read_text())["runs"] if "error" not in r}
        jobs = [j for j in jobs if _key(j) not in done]
    if args.short_first:  # when the time left may not cover everything, the cheap runs first
        jobs.sort(key=lambda j: (j["layers"], j["seed"]))
    else:  # the longest (24 layers, full AttnRes) first so that the tail of the run stays short
        jobs.sort(key=lambda j: (-j["layers"], j["scheme"] != "attnres"))
    return jobs


def _key(job: dict) -> tuple:
    return (job["model"], job["layers"], job["scheme"], job["corpus"], job["seed"])


def run_job(job: dict, args, gpu: int) -> dict:
    import torch

    from depthrewrite.train.data import DataConfig
    from depthrewrite.train.loop import TrainConfig, train

    if torch.cuda.is_available():
        torch.cuda.set_device(gpu)
    options = dict(SCHEMES.get(job["scheme"], {}))
    if job["model"].startswith("moe") and job["scheme"] == "dar":
        options = {"layers_per_block": 2}
    config = TrainConfig(
        model=job["model"], layers=job["layers"], scheme=job["scheme"], options=options,
        data=DataConfig(source=str(pathlib.Path(args.data_dir) / job["corpus"]), doc_bytes=2048),
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=50,
        precision="bf16", seed=job["seed"], device=f"cuda:{gpu}" if torch.cuda.is_available() else "cpu", eval_every=args.steps // 4,
        eval_batches=args.eval_batches, progress=False, threads=1,
    )
    start = time.perf_counter()
    result = train(config)
    return dict(job, options=options, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                train_loss=[round(x, 4) for x in result.losses[:: max(1, args.steps // 100)]],
                final_train_loss=result.final_train_loss, val=result.val,
                final_val_loss=result.final_val_loss, tokens_per_s=result.tokens_per_s,
                params=result.params, new_params=result.new_params, seconds=time.perf_counter() - start)


def worker(queue, results, args, gpu):
    while True:
        job = queue.get()
        if job is None:
            return
        try:
            results.put(run_job(job, args, gpu))
        except Exception as exc:  # one failed run must not sink the study: record why
            results.put(dict(job, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--extra-seeds", type=int, default=2)
    parser.add_argument("--deep-layers", type=int, nargs="*", default=[],
                        help="deeper GPTs (e.g. 48), trained on the first corpus only")
    parser.add_argument("--deep-schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--workers-per-gpu", type=int, default=6)
    parser.add_argument("--skip-done", help="study.json of an earlier call: skip the runs it holds")
    parser.add_argument("--short-first", action="store_true", help="run the cheapest runs first")
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("validation_study: no CUDA device")
    jobs = grid(args)
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    for job in jobs:
        queue.put(job)
    procs = [ctx.Process(target=worker, args=(queue, results, args, g % gpus))
             for g in range(gpus * args.workers_per_gpu)]
    for _ in procs:
        queue.put(None)
    for p in procs:
        p.start()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpus=[torch.cuda.get_device_name(i) for i in range(gpus)], torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), args=vars(args), jobs=len(jobs))
    records = []
    for _ in jobs:  # written after every run: a study cut short by a time limit keeps what ran
        records.append(results.get())
        (out / "study.json").write_text(json.dumps(dict(meta=meta, runs=records), indent=1))
    for p in procs:
        p.join()
    print(f"{'model':10s} {'L':>3s} {'corpus':22s} {'seed':>4s} {'scheme':14s} {'val':>7s} {'tok/s':>9s}")
    for r in sorted(records, key=lambda r: (r["model"], r["layers"], r["corpus"], r["seed"], r["scheme"])):
        val = f"{r['final_val_loss']:.4f}" if "error" not in r else "ERROR"
        tps = f"{r['tokens_per_s']:.0f}" if "error" not in r else r["error"][:40]
        print(f"{r['model']:10s} {r['layers']:3d} {r['corpus']:22s} {r['seed']:4d} {r['scheme']:14s} {val:>7s} {tps:>9s}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
