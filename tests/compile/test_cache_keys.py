"""The backend's settings are part of Inductor's cache keys (:mod:`depthrewrite.inductor_pass`):
a compilation whose settings differ from a cached one's compiles anew, one with the same
settings loads it. Node metadata (the recomputation marks) is not part of the compile
caches' keys, and the fences come from a setting the graph does not show, so both must
reach the keys through the backend pass's ``uuid``.

One model in one empty cache folder for every setting (until session 65 two tests, each in
a folder of its own, compiled DAR and WAV four times between them; about 40 s of CI's time
more)."""

from __future__ import annotations

import torch

import depthrewrite
from depthrewrite import backend, inductor_pass, sum_fences
from depthrewrite.models.gpt import GPT, GPTConfig


def test_settings_are_part_of_inductor_cache_keys(monkeypatch, tmp_path):
    """WAV (one block of 4 sites, 2 layers) compiled with Inductor four times in an empty
    cache folder: partial sums kept, then recomputed (compiled again, and keeps less: the
    marks are in the key), then fenced at 2 terms (compiled again, fenced), then with those
    settings again (loaded from the caches the third left: no graph compiled here, so no
    fences counted, and it runs forward and backward)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sum_fences, "MIN_NUMEL", 0)  # the tiny model's sums fenced too
    assert inductor_pass.backend_pass(2, False).uuid() != inductor_pass.backend_pass(4, False).uuid()
    assert inductor_pass.backend_pass(2, False, then=lambda g: None).uuid() is None  # unknown user pass: no caching
    torch.manual_seed(0)
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=16)), "wav",
                                 block_size=4).train()
    idx = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))

    def compiled_with(**options):
        torch._dynamo.reset()
        backend.clear_reports()
        compiled = torch.compile(model, backend="depthrewrite", fullgraph=True, options=options)
        compiled(idx, idx)[1].backward()
        return backend.last_report()

    kept = compiled_with(recompute_partial_sums=False)
    recomputed = compiled_with(recompute_partial_sums=True)
    fenced = compiled_with(recompute_partial_sums=True, max_sum_terms=2)
    again = compiled_with(recompute_partial_sums=True, max_sum_terms=2)
    # each of the first three compiled its backward here: nothing loaded another's
    assert kept.saved_for_backward and recomputed.saved_for_backward and fenced.saved_for_backward
    assert recomputed.saved_for_backward["bytes"] < kept.saved_for_backward["bytes"]
    assert not any(kept.fences.values()) and not any(recomputed.fences.values()) and fenced.fences["backward"] > 0
    # the third's settings: served from the caches it filled
    assert again.aot_graphs == {} and again.fences == {}
