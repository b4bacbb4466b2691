"""benchmarks/gradient_accuracy.py's summary: errors grouped by the gradient's kind (its last
name), each kind's median and largest, then over every gradient."""

from tests.benchmark_scripts import load_benchmark


def test_errors_are_summarised_by_kind_and_over_all():
    accuracy = load_benchmark("gradient_accuracy")
    errors = {"blocks.0.depth_route.site1.mix": 1e-3, "blocks.1.depth_route.site1.mix": 3e-3,
              "blocks.2.depth_route.site1.mix": 2e-3, "blocks.0.attn.qkv.weight": 5e-6}
    kinds = accuracy.by_kind(errors)
    assert list(kinds) == ["mix", "weight", "all"]
    assert kinds["mix"] == (2e-3, 3e-3)
    assert kinds["weight"] == (5e-6, 5e-6)
    assert kinds["all"] == ((1e-3 + 2e-3) / 2, 3e-3)  # the median of an even count: the mean of the middle two


def test_the_shortcut_runs_change_the_routing_gradients_compiled_too_and_put_the_op_back():
    """The ``shortcut`` runs emulate the kernels' ``<out, g>``: eager and under Inductor the
    routing queries' gradients differ from the runs without it (a compile cache once brought
    back a backward traced without it, silently), and the op is restored afterwards. Block
    AttnRes on one layer (one block of 2 sites, and the readout): of the schemes calling
    ``route_many``, it compiles under Inductor in the least time."""
    import importlib

    import torch

    accuracy = load_benchmark("gradient_accuracy")
    check = accuracy.check
    model = check._model("block_attnres", "cpu", check.Setup(layers=1, batch=(2, 16)))
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    module = importlib.import_module("depthrewrite.ops.route_many")
    op = module._route_many_backward_op
    grads = {way: accuracy.run_grads(way, model, idx, "bf16")
             for way in ("reference", "shortcut", "inductor", "inductor_shortcut")}
    assert module._route_many_backward_op is op
    name = "norm_final.depth_route.readout.query"  # reads the embedding and block 0
    assert name in grads["reference"]
    assert not torch.equal(grads["shortcut"][name], grads["reference"][name])
    assert not torch.equal(grads["inductor_shortcut"][name], grads["inductor"][name])
