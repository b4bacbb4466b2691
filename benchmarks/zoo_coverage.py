"""Model-zoo coverage: which decoder-only causal-LM families of the installed transformers
does depthrewrite rewrite?

    /work/venv/bin/python benchmarks/zoo_coverage.py --write docs/coverage.md

Every family of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from a shrunken default
config with random weights (no download), in its own subprocess with a timeout (a hang or
crash of one family cannot stop the survey), two at a time. Each buildable family is
inspected and rewritten four ways (attnres and dar, each with and without
``preserve_identity``); the identity rewrites must reproduce the original logits bit for
bit. Status per family:

- ``rewritten``: all four rewrites ran and both identity rewrites are bit-identical;
- ``refused``: depthrewrite raised a ``DepthRewriteError`` (a declared limitation);
- ``failed``: any other exception, or an identity rewrite that changed the logits;
- ``not buildable``: the small config or the model could not be constructed;
- ``skipped``: too large from a small config, not decoder-only, or timed out.

``check_family`` is the single implementation of the per-family check; tests/zoo imports it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

#: families above this many parameters (counted on the meta device) are not built
MAX_PARAMS = 30_000_000
#: the shrunken sizes, and every config field name we know for each
SMALL = {
    ("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "model_dim", "dim", "hidden_dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "num_heads", "n_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "multi_query_group_num"): 2,
    ("head_dim", "kv_channels", "attention_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
     "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "d_head"): 16,
    ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "moe_intermediate_size",
     "shared_expert_intermediate_size", "expert_intermediate_size", "dense_intermediate_size",
     "ffn_hidden_dim", "mlp_dim"): 128,
    ("vocab_size",): 128,
    ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts", "moe_k"): 2,
    ("rotary_dim",): 8,
    ("num_kv_shared_layers",): 0,  # KV sharing across the last layers needs more than two
    ("hidden_size_per_layer_input",): 16,
    ("vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"): 128,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"): 256,
    ("q_lora_rank",): 32,
    ("kv_lora_rank",): 32,
    ("n_group", "topk_group"): 1,
    ("num_key_value_groups",): 2,
    ("linear_num_key_heads", "linear_num_value_heads"): 2,
    ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"): 0,
}
#: fields where the default's value "None" means "off" and must stay off
_KEEP_NONE = {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "q_lora_rank",
              "head_dim", "n_inner", "sliding_window"}
SCHEME_RUNS = (("attnres", False), ("attnres", True), ("dar", False), ("dar", True))
TIMEOUT_S = 60
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    family: str
    status: str
    sites: int | None = None
    params: int | None = None
    detail: str = ""
    cause: str = ""  # the failing step, for grouping failures
    seconds: float = 0.0
    runs: dict = field(default_factory=dict)


def causal_lm_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink_fields(defaults: dict, mha: bool = False) -> dict:
    """The SMALL values for the fields ``defaults`` (a config's to_dict) has, plus per-layer
    lists cut to the new layer count."""
    fields = {}
    for names, value in SMALL.items():
        for name in names:
            if name in defaults and not (defaults[name] is None and name in _KEEP_NONE) \
                    and not isinstance(defaults[name], (dict, list, bool)):
                fields[name] = value
    layers = next((defaults[n] for n in SMALL_LAYER_FIELDS if isinstance(defaults.get(n), int)), None)
    sized = {name: value for names, value in SMALL.items() for name in names}
    for name, value in defaults.items():
        # per-layer lists (layer_types, block types...) must match the new depth
        if isinstance(value, list) and layers and len(value) == layers and value:
            fields[name] = [sized[name]] * 2 if name in sized else _two_layers(value)
        # per-layer overrides keyed by layer index: keep those of the first two layers
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            fields[name] = {k: v for k, v in value.items() if int(k) < 2}
    if mha:
        fields.update({n: 4 for n in KV_HEAD_FIELDS if n in fields})
    return fields


def _two_layers(values: list) -> list:
    """Two entries of a per-layer list, of two different kinds where it has them (a
    sliding and a full attention layer, say), so that both kinds get built."""
    first = values[0]
    other = next((v for v in values if v != first), first)
    return [first, other] if values.index(other) > 0 else [first, first]


SMALL_LAYER_FIELDS = next(names for names in SMALL if "num_hidden_layers" in names)
KV_HEAD_FIELDS = next(names for names in SMALL if "num_key_value_heads" in names)


def small_config(family: str, mha: bool = False):
    """The default config of ``family`` with its text (and any sub-) configs shrunk;
    ``mha``: as many key/value heads as query heads (some attentions, e.g. MLA, need it)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    defaults = cls().to_dict()
    fields = _shrink_fields(defaults, mha)
    for key, value in defaults.items():
        # composite configs (text_config, vision_config...): shrink each sub-config too
        if isinstance(value, dict) and "model_type" in value:
            sub = dict(value)
            sub.update(_shrink_fields(value, mha))
            fields[key] = sub
    return cls(**fields)


def _count_params_meta(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _last_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.relpath(f.filename, REPO) if f.filename.startswith(REPO) else f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}"


def _describe(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:400]} [{_last_frame(exc)}]"


def _build(family: str, mha: bool = False):
    """(model, params) or a Result saying why not."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = small_config(family, mha)
    except Exception as e:  # noqa: BLE001 - any config error makes the family not buildable
        return Result(family, "not buildable", detail="config: " + _describe(e), cause="config")
    if getattr(config, "is_encoder_decoder", False):
        return Result(family, "skipped", detail="not decoder-only (encoder-decoder)", cause="encoder-decoder")
    try:
        params = _count_params_meta(config)
    except Exception as e:  # noqa: BLE001
        return Result(family, "not buildable", detail="model (meta): " + _describe(e), cause="model")
    if params > MAX_PARAMS:
        return Result(family, "skipped", params=params,
                      detail=f"too large from a small config ({params / 1e6:.1f}M parameters)", cause="too large")
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    except Exception as e:  # noqa: BLE001
        return Result(family, "not buildable", params=params, detail="model: " + _describe(e), cause="model")
    return model, params


def _logits(model, args, kwargs):
    import torch
    from depthrewrite.capture import first_tensor

    with torch.no_grad():
        return first_tensor(model(*args, **kwargs))


def check_model(family: str, model, params: int | None = None) -> Result:
    """Inspect ``model`` and rewrite copies of it four ways; classify the outcome."""
    import torch
    import depthrewrite
    from depthrewrite.capture import default_example_inputs

    start = time.perf_counter()
    result = Result(family, "rewritten", params=params)
    try:
        args, kwargs = default_example_inputs(model)
        reference = _logits(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the original model itself does not run
        return _finish(result, "not buildable", "forward: " + _describe(e), "forward", start)
    step = "inspect"
    try:
        result.sites = depthrewrite.inspect(model).num_sites
        for scheme, identity in SCHEME_RUNS:
            step = f"{scheme}{' preserve_identity' if identity else ''}"
            rewritten = depthrewrite.rewrite(copy.deepcopy(model), scheme, preserve_identity=identity)
            out = _logits(rewritten, args, kwargs)
            if identity and not torch.equal(out, reference):
                diff = (out.double() - reference.double()).abs().max().item()
                return _finish(result, "failed", f"{step}: logits differ from the original by up to {diff:.3g}",
                               "identity broken", start)
            if not torch.isfinite(out).all():
                return _finish(result, "failed", f"{step}: non-finite logits", "non-finite", start)
            result.runs[step] = "ok"
    except depthrewrite.DepthRewriteError as e:
        # the library's own verification failing is a bug, not a declared limitation
        status = "failed" if str(e).startswith("verification:") else "refused"
        return _finish(result, status, f"{step}: " + _describe(e), type(e).__name__, start)
    except Exception as e:  # noqa: BLE001 - every other exception is a failure to report
        return _finish(result, "failed", f"{step}: " + _describe(e), type(e).__name__, start)
    return _finish(result, "rewritten", f"{result.sites} sites; 4 rewrites ok, identity bit-exact", "", start)


def _finish(result: Result, status: str, detail: str, cause: str, start: float) -> Result:
    result.status, result.detail, result.cause = status, detail, cause
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def check_family(family: str) -> Result:
    """The whole per-family check, in this process: build, then ``check_model``."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    result = None
    for mha in (False, True):  # grouped kv heads first; plain multi-head if that does not build
        built = _build(family, mha)
        if isinstance(built, Result):
            result = built
        else:
            result = check_model(family, *built)
        if result.status != "not buildable":
            break
    return result


def _run_one_subprocess(family: str, timeout: float) -> Result:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", family],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(family, "skipped", detail=f"timed out after {timeout:.0f} s", cause="timeout",
                      seconds=round(time.perf_counter() - start, 1))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-400:]
        return Result(family, "failed", detail=f"subprocess exited {proc.returncode}: {tail}",
                      cause="crash", seconds=round(time.perf_counter() - start, 1))
    return Result(**json.loads(lines[-1]))


def survey(families: list[str], workers: int, timeout: float) -> list[Result]:
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_one_subprocess, f, timeout): f for f in families}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            print(f"{r.family:28s} {r.status:14s} {r.detail[:150]}", flush=True)
            results.append(r)
    return sorted(results, key=lambda r: r.family)


def coverage(results: list[Result]) -> dict:
    count = {s: sum(r.status == s for r in results) for s in
             ("rewritten", "refused", "failed", "not buildable", "skipped")}
    ok, ref, bad = count["rewritten"], count["refused"], count["failed"]
    count["coverage"] = ok / (ok + ref + bad) if ok + ref + bad else float("nan")
    count["prenorm_coverage"] = ok / (ok + bad) if ok + bad else float("nan")
    return count


def markdown(results: list[Result], command: str) -> str:
    import torch
    import transformers

    c = coverage(results)
    lines = [
        "# Model-zoo coverage",
        "",
        f"Regenerate: `{command}`",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU ({platform.system()})",
        "- date: 2026-11-29",
        f"- transformers {transformers.__version__}, torch {torch.__version__}",
        f"- families: every key of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)}), each built "
        "from its default config shrunk to hidden 64, 2 layers, 4 heads (2 kv), head_dim 16, "
        "intermediate 128, vocab 128, 4 experts top-2; random weights; one subprocess each, "
        f"{TIMEOUT_S} s timeout",
        "- check: `inspect`, then `rewrite` with attnres and dar, each with and without "
        "`preserve_identity` (identity rewrites must give bit-identical logits, `torch.equal`)",
        "",
        f"**Coverage** (rewritten / (rewritten + refused + failed), buildable decoder-only families): "
        f"{c['rewritten']} / {c['rewritten'] + c['refused'] + c['failed']} = {c['coverage']:.1%}",
        "",
        f"**PreNorm coverage** (rewritten / (rewritten + failed); refusals are declared non-PreNorm "
        f"or unsupported structures): {c['rewritten']} / {c['rewritten'] + c['failed']} = "
        f"{c['prenorm_coverage']:.1%}",
        "",
        f"Counts: rewritten {c['rewritten']}, refused {c['refused']}, failed {c['failed']}, "
        f"not buildable {c['not buildable']}, skipped {c['skipped']}.",
        "",
        "| family | status | sites | detail |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.family} | {r.status} | {'' if r.sites is None else r.sites} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", metavar="FAMILY", help="check one family in this process, print JSON")
    parser.add_argument("--families", nargs="*", help="survey only these families")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--update", metavar="JSON", help="merge into the results of an earlier --json run")
    parser.add_argument("--write", metavar="PATH", help="write the markdown report here")
    parser.add_argument("--json", metavar="PATH", help="write the raw results here")
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        sys.path.insert(0, REPO)
        print(json.dumps(asdict(check_family(args.one))), flush=True)
        return 0
    families = args.families or causal_lm_families()
    results = survey(families, args.workers, args.timeout)
    if args.update:
        # re-survey some families and keep the earlier results of the others
        with open(args.update) as f:
            earlier = {r["family"]: Result(**r) for r in json.load(f)}
        earlier.update({r.family: r for r in results})
        results = sorted(earlier.values(), key=lambda r: r.family)
        args.json = args.json or args.update
    c = coverage(results)
    print(f"\ncoverage: {c['rewritten']}/{c['rewritten'] + c['refused'] + c['failed']} = {c['coverage']:.1%}; "
          f"PreNorm coverage: {c['rewritten']}/{c['rewritten'] + c['failed']} = {c['prenorm_coverage']:.1%}; "
          f"counts {c}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.write:
        command = "/work/venv/bin/python benchmarks/zoo_coverage.py --write " + args.write
        with open(args.write, "w") as f:
            f.write(markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
