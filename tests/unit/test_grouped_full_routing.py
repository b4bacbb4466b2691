"""Grouped full routing (``attnres`` / ``mhar`` full form, option ``group_size``): the
two-phase computation over groups of consecutive sites is the same function as one route
per site."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.passes import attnres, two_phase
from tests.unit.test_schemes_routed import ids_for, randomize_routing, rewrite, tiny

CASES = [("attnres", {"group_size": 1}), ("attnres", {"group_size": 2}), ("attnres", {"group_size": 3}),
         ("attnres", {"group_size": 4}), ("attnres", {"group_size": 50}), ("mhar", {"heads": 4, "group_size": 3})]


def _logits_and_grads(scheme, options, dtype, recompute=False, **model_options):
    model = rewrite(tiny(**model_options).to(dtype), scheme, recompute=recompute, **options)
    randomize_routing(model)
    logits = model(ids_for())
    loss = (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=dtype)).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, materialize_grads=True)
    return [logits, *grads], model


def _count_calls(monkeypatch) -> dict:
    """Calls of the routing functions, phase 1's (``two_phase``) and the routers' own
    (``attnres``) together."""
    calls = dict.fromkeys(("route", "route_many", "merge_partial", "merge_routes"), 0)
    for module, name in ((attnres, "route"), (attnres, "route_many"), (two_phase, "route_many"),
                         (attnres, "merge_partial"), (attnres, "merge_routes")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("scheme,options", CASES)
def test_grouped_routing_equals_routing_site_by_site(scheme, options, parallel, monkeypatch):
    """Logits and every parameter gradient in float64 equal one route per site (groups that
    do not divide the sites, a group longer than the model, groups of one); the calls are
    the plan's: one ``route_many`` per group for phase 1, then per router the group's own
    entries so far: none, one (``merge_partial``) or more (``route_many`` with one query and
    ``merge_routes``). In float32 as close to float64 as site-by-site routing is."""
    model_options = {"parallel_block": parallel}
    truth, site_by_site = _logits_and_grads(scheme, {k: v for k, v in options.items() if k != "group_size"},
                                            torch.float64, **model_options)
    calls = _count_calls(monkeypatch)
    exact, grouped = _logits_and_grads(scheme, options, torch.float64, **model_options)
    assert list(grouped.state_dict()) == list(site_by_site.state_dict())  # no parameter added or renamed
    size = options["group_size"]
    routers = len([n for n in grouped.state_dict() if n.endswith(".query")])  # sites and readout
    positions = [(i - 1) % size for i in range(1, routers + 1)]
    groups = (routers - 1) // size + 1
    assert calls == {"route": 0, "route_many": groups + sum(p >= 2 for p in positions),
                     "merge_partial": positions.count(1), "merge_routes": sum(p >= 2 for p in positions)}
    for a, b in zip(exact, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    single, _ = _logits_and_grads(scheme, options, torch.float32, **model_options)
    plain, _ = _logits_and_grads(scheme, {k: v for k, v in options.items() if k != "group_size"}, torch.float32,
                                 **model_options)
    for a, p, b in zip(single, plain, truth):
        scale = b.norm().clamp_min(1e-30)
        # within 4x of site by site's own float32 error (and a floor for tensors it gets exact)
        assert ((a.double() - b).norm() / scale).item() <= max(4 * ((p.double() - b).norm() / scale).item(), 1e-6)


@pytest.mark.parametrize("scheme,options", [("attnres", {"group_size": 4}), ("mhar", {"heads": 4, "group_size": 3})])
def test_direct_merge_of_a_groups_entries_is_the_same_function(scheme, options, monkeypatch):
    """``two_phase.DIRECT_MERGE_ENTRIES``: a router whose group made 2 to that many entries
    adds them as ``merge_routes``' own sources, without a ``route_many`` call: logits and
    every parameter gradient in float64 as one route per site, and the one-query calls gone."""
    truth, _ = _logits_and_grads(scheme, {k: v for k, v in options.items() if k != "group_size"}, torch.float64)
    calls = _count_calls(monkeypatch)
    monkeypatch.setattr(two_phase, "DIRECT_MERGE_ENTRIES", options["group_size"] - 1)
    direct, model = _logits_and_grads(scheme, options, torch.float64)
    size = options["group_size"]
    routers = len([n for n in model.state_dict() if n.endswith(".query")])
    positions = [(i - 1) % size for i in range(1, routers + 1)]
    assert calls["route_many"] == (routers - 1) // size + 1  # phase 1 only
    assert calls["merge_routes"] == sum(p >= 2 for p in positions) > 0
    for a, b in zip(direct, truth):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_recompute_gives_the_same_gradients_from_fewer_saved_tensors(monkeypatch):
    """``recompute=True`` (phase 1 under activation checkpointing): bit for bit the result of
    keeping phase 1's outputs, fewer bytes saved for the backward, phase 1 run again once
    per group in the backward."""
    from tests.unit.test_schemes_routed import _saved_bytes

    groups = []
    real = two_phase.TwoPhasePlan.first_phase
    monkeypatch.setattr(two_phase.TwoPhasePlan, "first_phase",
                        lambda self, *a, **k: groups.append(1) or real(self, *a, **k))
    results = {}
    for recompute in (False, True):
        model = rewrite(tiny(n_layer=3), "attnres", group_size=3, recompute=recompute)
        randomize_routing(model)
        logits, saved = _saved_bytes(lambda: model(ids_for()))
        grads = torch.autograd.grad((logits * torch.linspace(-1, 1, logits.shape[-1])).sum(), list(model.parameters()))
        results[recompute] = ([logits, *grads], saved)
    (kept, kept_bytes), (redone, redone_bytes) = results[False], results[True]
    for a, b in zip(redone, kept):
        assert torch.equal(a, b)
    assert redone_bytes < kept_bytes
    assert len(groups) == 2 * 3  # 7 routers in groups of 3: three groups, once per model


@pytest.mark.parametrize("scheme, options, kept", [
    ("block_attnres", {"block_size": 2}, 2),  # 6 sites: the readout in a group of its own
    ("block_attnres", {"block_size": 4}, 1),  # the readout joins sites 5 and 6
    ("dar", {}, 2),  # a group per layer, then the readout's
])
def test_the_last_groups_keep_phase_one_instead_of_recomputing_it(monkeypatch, scheme, options, kept):
    """``two_phase.KEEP_LAST_PHASE_ONE``: with ``recompute`` phase 1 of the last site's group
    and the readout's runs outside the checkpoint, bit for bit the gradients of recomputing
    every group."""
    checkpoints = []
    real = two_phase.checkpoint
    monkeypatch.setattr(two_phase, "checkpoint", lambda *a, **k: checkpoints.append(1) or real(*a, **k))
    results, counts = {}, {}
    for keep in (False, True):
        monkeypatch.setattr(two_phase, "KEEP_LAST_PHASE_ONE", keep)
        checkpoints.clear()
        results[keep] = _logits_and_grads(scheme, options, torch.float32, recompute=True)[0]
        counts[keep] = len(checkpoints)
    assert counts[False] > kept  # some group is still recomputed
    assert counts[True] == counts[False] - kept
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scheme, options", [("block_attnres", {"block_size": 2}), ("dar", {}),
                                             ("attnres", {"group_size": 2, "recompute": True})])
def test_keep_groups_keeps_phase_one_of_more_groups(monkeypatch, scheme, options):
    """``keep_groups=k``: k more groups than the last site's and the readout's run phase 1
    outside the checkpoint (the last ones before those), saving more for the backward; the
    same logits and gradients bit for bit; more than there are keeps every group."""
    from tests.unit.test_schemes_routed import _saved_bytes

    checkpoints = []
    real = two_phase.checkpoint
    monkeypatch.setattr(two_phase, "checkpoint", lambda *a, **k: checkpoints.append(1) or real(*a, **k))
    found, plans = {}, {}
    for keep in (0, 1, 50):
        model = rewrite(tiny(), scheme, keep_groups=keep, **options)
        plans[keep] = next(m._plan for m in model.modules() if getattr(m, "_plan", None) is not None)
        randomize_routing(model)
        checkpoints.clear()
        logits, saved = _saved_bytes(lambda: model(ids_for()))
        grads = torch.autograd.grad((logits * torch.linspace(-1, 1, logits.shape[-1])).sum(), list(model.parameters()),
                                    allow_unused=True, materialize_grads=True)
        found[keep] = ([logits, *grads], saved, len(checkpoints))
    (base, base_saved, base_checkpoints), (one, one_saved, one_checkpoints) = found[0], found[1]
    assert one_checkpoints == base_checkpoints - 1 and found[50][2] == 0
    assert base_saved < one_saved < found[50][1]
    for a, b, c in zip(one, base, found[50][0]):
        assert torch.equal(a, b) and torch.equal(c, b)
    # each case: 4 groups, the readout's its own; one more kept: the one before the last site's
    assert plans[1]._kept_groups() == set(sorted(plans[1].groups)[-3:]) and len(plans[1].groups) == 4
    assert plans[50]._kept_groups() == set(plans[50].groups)


def test_grouped_routing_is_skipped_for_shards_it_cannot_gather(monkeypatch):
    """As for the block schemes: with shards that phase 1 cannot gather (not FSDP2's) the
    plan routes site by site."""
    model = rewrite(tiny(), "attnres", group_size=2)
    reference = rewrite(tiny(), "attnres", group_size=None)  # site by site
    randomize_routing(model)
    reference.load_state_dict(model.state_dict())
    monkeypatch.setattr(two_phase, "_is_sharded", lambda p: True)
    for module in (two_phase, attnres):  # neither phase runs
        monkeypatch.setattr(module, "route_many", lambda *a, **k: pytest.fail("two-phase ran on sharded parameters"))
    ids = ids_for()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-6, atol=1e-6)


def test_routing_weights_are_recorded_per_site_with_groups():
    """The routing-weight recorder switches the plan off: every site routes over all its
    entries, and the weights are the site-by-site model's."""
    from depthrewrite.routing_weights import record_routing_weights

    model = rewrite(tiny(), "attnres", group_size=2)
    reference = rewrite(tiny(), "attnres", group_size=None)  # site by site
    randomize_routing(model)
    reference.load_state_dict(model.state_dict())
    got, want = record_routing_weights(model, ids_for()), record_routing_weights(reference, ids_for())
    assert got.labels == want.labels and got.source_labels == want.source_labels
    for a, b in zip(got.weights, want.weights):
        torch.testing.assert_close(a, b)
    # the plan is back on afterwards: the next forward groups again
    plans = {id(r._plan) for r in model.modules() if getattr(r, "_plan", None) is not None}
    assert len(plans) == 1 and all(r._plan.enabled for r in model.modules() if getattr(r, "_plan", None))


@pytest.mark.parametrize("scheme,options,message", [
    ("attnres", {"group_size": 0}, r"attnres: group_size must be None \(one route per site\) or a positive int, "
                                   r"found 0"),
    ("attnres", {"group_size": True}, r"attnres: group_size must be None .* found True"),
    ("mhar", {"heads": 2, "group_size": "6"}, r"mhar: group_size must be None .* found '6'"),
    ("mhar", {"heads": 2, "block_size": 2, "group_size": 3}, r"mhar: group_size groups the sites of the full form; "
                                                             r"with block_size=2 use two_phase=True instead"),
    ("attnres", {"group_size": 2, "recompute": 1}, r"attnres: recompute must be True or False, found 1"),
    ("block_attnres", {"keep_groups": -1}, r"block_attnres: keep_groups must be an int >= 0, found -1"),
    ("dar", {"keep_groups": 1.0}, r"dar: keep_groups must be an int >= 0, found 1.0"),
    ("block_attnres", {"keep_groups": 2, "recompute": False},
     r"block_attnres: keep_groups=2 applies only to two-phase or grouped routing with recompute=True .* found "
     r"recompute=False"),
    ("attnres", {"keep_groups": 1, "group_size": None},
     r"attnres: keep_groups=1 applies only .* found no two-phase or grouped routing"),
])
def test_bad_group_options_are_value_errors_naming_them(scheme, options, message):
    with pytest.raises(ValueError, match=message):
        rewrite(tiny(), scheme, **options)


@pytest.mark.parametrize("scheme,options", [("attnres", {"group_size": 3}), ("mhar", {"heads": 4, "group_size": 2})])
def test_grouped_routing_compiles_fullgraph_and_matches_eager(scheme, options):
    """With the backend (AOTAutograd, fullgraph): the same loss and gradients as eager, and
    the phase-1 and phase-2 ``route_many`` calls reach the backend as routing ops."""
    from depthrewrite import backend
    from tests.compile.test_backend import assert_aot_eager_matches_eager

    model = rewrite(tiny(n_layer=2), scheme, **options).train()
    randomize_routing(model)
    assert_aot_eager_matches_eager(model, ids_for(seed=3))
    ops = backend.last_report().ops
    assert ops.get("depthrewrite::route_many", 0) > 0 and "depthrewrite::route" not in ops
