"""`quantkit merge`: LoRA adapters merged into their base, written as a 16-bit safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import (
    MODEL,
    err,
    handle_errors,
    lean_transformers,
    progress,
    results_console,
    write_json,
)
from quantkit.cli.options import LORA, LORA_WEIGHT, MERGE_BASE, ORIGINAL_BASE, OUTPUT, OVERWRITE, TRUST_REMOTE_CODE, json_flag


@handle_errors
@lean_transformers
def merge(
    base: str = typer.Argument(..., help="Base checkpoint dir, or a Hub id org/name[@revision]; a bitsandbytes 4-bit (QLoRA) base is dequantized first.", rich_help_panel=MODEL),
    lora: list[str] = LORA.option(default=..., help="LoRA adapter dir (peft, safetensors); repeatable, merged in order."),
    lora_weight: list[float] = LORA_WEIGHT.option(help="Scale of each adapter's update, one per --lora in order (default 1.0)."),
    output: Path = OUTPUT.option(),
    merge_base: str = MERGE_BASE.option(default="dequantized", help="For a QLoRA base: dequantized (the 4-bit weights the adapter was trained against) | original (the 16-bit --original-base)."),
    original_base: Optional[str] = ORIGINAL_BASE.option(help="The 16-bit original of a QLoRA base (with --merge-base original)."),
    trust_remote_code: bool = TRUST_REMOTE_CODE.option(help="Allow custom model code from the base dir."),
    overwrite: bool = OVERWRITE.option(),
    json_path: Optional[str] = json_flag("the merge record").option(),
) -> None:
    """Merge LoRA adapters into their base and save a safetensors checkpoint (tokenizer, model card,
    quantkit.json), ready for `quantkit quantize`.

    Examples:

      quantkit merge ./base --lora ./adapter -o ./merged

      quantkit merge ./base --lora ./style --lora ./domain --lora-weight 0.5 --lora-weight 1.0 -o ./merged

      quantkit merge ./base-bnb-4bit --lora ./qlora-adapter -o ./merged          (dequantized 4-bit base)

      quantkit merge ./base-bnb-4bit --lora ./qlora-adapter --merge-base original --original-base ./base -o ./merged

    The update is computed in float32 and rounded once to the base's dtype. Exit codes: 0 ok,
    2 bad input (checked before any work).
    """
    from quantkit.io import export
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.run.lora import plan_merge, write_merged

    info = check_model_dir(resolve_model(base))
    export.check_output(output, overwrite)
    plan = plan_merge(info, base, lora, lora_weight, merge_base, original_base, trust_remote_code)
    for warning in plan.warnings:
        err.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
    record = write_merged(plan, output, overwrite, progress)
    write_json(json_path, record)
    results_console(json_path).print(f"wrote {output}", highlight=False)
