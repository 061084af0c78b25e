"""The token windows of a run: calibration windows for the methods and held-out evaluation windows
for the gate, disjoint (quantkit.run.calibration packs them from the calibration text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets
    import torch


@dataclass
class TokenWindows:
    """Packed token windows: calibration and held-out evaluation sets, disjoint."""

    calib: torch.LongTensor
    eval: torch.LongTensor
    source: str
    sha256: str

    def calib_dataset(self, share: slice = slice(None)) -> datasets.Dataset:
        """The calibration windows (those in `share`: a torchrun rank's) as a Dataset with input_ids
        and attention_mask."""
        import datasets

        ids = self.calib[share].tolist()
        mask = [[1] * len(row) for row in ids]
        return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask})
