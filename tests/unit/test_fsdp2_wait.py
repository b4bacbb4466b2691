"""depthrewrite.fsdp2.wait_for_fsdp_reductions: before our end-of-backward addition reads a
sharded parameter's ``.grad``, the current stream waits for what FSDP2 has issued into it
and not yet waited for (its post-reduce event, and under HSDP its all-reduce's), as
FSDP2's own final callback would. Needed where our callback runs before that one (a
re-entrant checkpoint's nested backward); the race itself needs several GPUs. And how the
groups holding parameters are found: walked once, then cached, weakly both ways. FSDP2's
groups are stood in for here: the rules are which events the stream is made to wait for and
when the groups are walked."""

from types import SimpleNamespace

import torch

from depthrewrite import fsdp2


class _Stream:
    def __init__(self, waited: list):
        self.waited = waited

    def wait_event(self, event) -> None:
        self.waited.append(event)


def _group(waited: list, post_reduce=None, all_reduce=None):
    handle = SimpleNamespace(current_stream=lambda: _Stream(waited))
    state = None if all_reduce is None else SimpleNamespace(event=all_reduce)
    return SimpleNamespace(device_handle=handle, _post_reduce_event=post_reduce, _all_reduce_state=state)


def test_the_stream_waits_for_each_holding_groups_pending_reductions_once(monkeypatch):
    waited = []
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    pending = _group(waited, post_reduce="reduce-1")
    hsdp = _group(waited, post_reduce="reduce-2", all_reduce="all-reduce-2")
    done = _group(waited)  # FSDP2 has waited already: its events are cleared
    groups = {id(a): pending, id(b): hsdp, id(c): done, id(d): pending}  # a and d: one group
    monkeypatch.setattr(fsdp2, "_fsdp_groups_of", lambda params: {id(p): groups[id(p)] for p in params})
    fsdp2.wait_for_fsdp_reductions([a, b, c, d])
    assert waited == ["reduce-1", "reduce-2", "all-reduce-2"]
    # the events stay for FSDP2 to wait for and clear itself
    assert pending._post_reduce_event == "reduce-1" and hsdp._all_reduce_state.event == "all-reduce-2"



class _Group:
    """A stand-in for an FSDP2 parameter group (weakly referable, as FSDP2's are)."""


def test_a_parameters_group_is_found_once_and_held_weakly(monkeypatch):
    import gc

    walks = []
    groups = {}

    def walk(params):
        walks.append(len(params))
        return {id(p): groups[id(p)] for p in params if id(p) in groups}

    monkeypatch.setattr(fsdp2, "_walk_fsdp_groups", walk)
    a, b = torch.zeros(2), torch.zeros(3)
    first = _Group()
    groups.update({id(a): first, id(b): first})
    assert fsdp2._fsdp_groups_of([a, b]) == {id(a): first, id(b): first}
    assert fsdp2._fsdp_groups_of([a, b]) == {id(a): first, id(b): first}
    assert walks == [2]  # the second answer came from the cache
    # the cache holds neither: a dropped group is looked for again, a dropped parameter leaves it
    second = _Group()
    groups.update({id(a): second, id(b): second})
    del first
    gc.collect()
    assert fsdp2._fsdp_groups_of([a, b]) == {id(a): second, id(b): second}
    assert walks == [2, 2]
    held = len(fsdp2._GROUP_OF)
    del b
    gc.collect()
    assert len(fsdp2._GROUP_OF) == held - 1
