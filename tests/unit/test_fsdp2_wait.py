"""depthrewrite.fsdp2.wait_for_fsdp_reductions: before our end-of-backward addition reads a
sharded parameter's ``.grad``, the current stream waits for what FSDP2 has issued into it
and not yet waited for (its post-reduce event, and under HSDP its all-reduce's), as
FSDP2's own final callback would. Needed where our callback runs before that one (a
re-entrant checkpoint's nested backward); the race itself needs several GPUs. FSDP2's
groups are stood in for here: the rule is which events the stream is made to wait for."""

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

