"""The gguf method's imatrix streams the checkpoint a layer at a time and equals the in-memory one."""

from __future__ import annotations

import numpy as np

from quantkit.gguf import imatrix as im


def test_streamed_imatrix_equals_in_memory(micro, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.windows import TokenWindows
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import QuantizeJob
    from quantkit.methods.gguf import Options, compute_imatrix

    windows = torch.randint(0, 500, (3, 32), generator=torch.Generator().manual_seed(1))
    info = check_model_dir(micro)
    job = QuantizeJob(info=info, options=Options(gguf_type="Q4_K_M"),
                      windows=TokenWindows(windows, windows[:0], "unit", ""), ignore=[], out_dir=tmp_path,
                      workdir=tmp_path)
    streamed = compute_imatrix(job, windows)
    model = AutoModelForCausalLM.from_pretrained(micro, dtype="auto").eval()  # the stored dtype, as streamed
    direct = im.compute(model, windows, info.config)
    assert set(streamed.sums) == set(direct.sums) and len(streamed.sums) == 14
    for name in direct.sums:
        np.testing.assert_allclose(streamed.sums[name], direct.sums[name], rtol=2e-2, err_msg=name)
        assert streamed.counts[name] == direct.counts[name]
