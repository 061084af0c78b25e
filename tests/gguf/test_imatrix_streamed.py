"""The gguf method's imatrix: the checkpoint whole where the run's placement has room, else streamed a layer at a
time; both equal the one of the model transformers loads."""

from __future__ import annotations

import numpy as np

from quantkit.gguf import imatrix as im


def test_streamed_imatrix_equals_in_memory(micro, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from dataclasses import replace

    from quantkit.eval.scorers import Placement
    from quantkit.eval.windows import TokenWindows
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import QuantizeJob
    from quantkit.methods.gguf import Options, compute_imatrix

    windows = torch.randint(0, 500, (3, 32), generator=torch.Generator().manual_seed(1))
    info = check_model_dir(micro)
    job = QuantizeJob(info=info, options=Options(gguf_type="Q4_K_M"),
                      windows=TokenWindows(windows, windows[:0], "unit", ""), ignore=[], out_dir=tmp_path,
                      workdir=tmp_path)
    said = []
    streamed = compute_imatrix(replace(job, progress=said.append), windows)
    whole = compute_imatrix(replace(job, placement=Placement(True, room=2**30), progress=said.append), windows)
    assert said == ["imatrix: the model streamed a layer at a time", "imatrix: the model whole in memory"]
    model = AutoModelForCausalLM.from_pretrained(micro, dtype="auto").eval()  # the stored dtype, as streamed
    direct = im.compute(model, windows, info.config)
    assert set(streamed.sums) == set(direct.sums) == set(whole.sums) and len(streamed.sums) == 14
    for name in direct.sums:
        for computed in (streamed, whole):
            np.testing.assert_allclose(computed.sums[name], direct.sums[name], rtol=2e-2, err_msg=name)
            assert computed.counts[name] == direct.counts[name]
