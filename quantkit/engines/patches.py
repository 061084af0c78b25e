"""Every run-time replacement of third-party code quantkit makes, in one inventory.

quantkit swaps a library's function for its own only where it does the same work with less memory,
or where the library is wrong for quantkit's case. Each entry of PATCHES names its site (module and
attribute; "Class.method" for a method), the package that owns it, the versions the replacement was
verified against, the replacement ("module:function"; with `wraps`, a function that builds the
replacement from the original), and why. `patched(*names)` swaps the named entries while inside and
restores the originals on exit, also when the body raises. A site that is gone, or a package at a
version outside the verified ones, raises before anything is swapped (InternalError naming the
entry): an upgrade of a pinned engine is refused rather than patched blind.
tests/engines/test_patches.py checks that every site exists with the signature its replacement
takes.

Attributes quantkit writes on third-party objects are listed in WRITES (they replace no code).
"""

from __future__ import annotations

import importlib
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from quantkit.errors import InternalError

Site = tuple[str, str]  # (module, "function" or "Class.method") the library calls through

LLMCOMPRESSOR = "==0.14.0.1"
COMPRESSED_TENSORS = "==0.19.0"
TRANSFORMERS = ">=5.0,<=5.17"
AUTO_ROUND = "==0.15.1"


@dataclass(frozen=True)
class Patch:
    site: Site
    package: str  # the distribution that owns the site
    verified: str  # the versions it was verified against, as a specifier
    replacement: str  # "module:function"
    why: str
    wraps: bool = False  # the replacement is built by calling the function with the original


PATCHES: dict[str, Patch] = {
    "gptq.accumulate_hessian": Patch(
        ("llmcompressor.modifiers.gptq.base", "accumulate_hessian"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.lean_hessian:accumulate_hessian",
        "X X^T accumulated a block of rows at a time into one Hessian (llm-compressor makes a second one "
        "per calibration batch)"),
    "gptq.prepare_batch": Patch(
        ("llmcompressor.modifiers.gptq.base", "prepare_batch"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.lean_hessian:prepare_batch",
        "the Hessian divided in place and the batch stacked as a view, no copies"),
    "gptq.apply_activation_ordering": Patch(
        ("llmcompressor.modifiers.gptq.gptq_quantize", "apply_activation_ordering"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.lean_hessian:apply_activation_ordering",
        "act-order's permutation of the Hessian and the weight gathered in place by row slabs"),
    "gptq.factorize_hessian": Patch(
        ("llmcompressor.modifiers.gptq.gptq_quantize", "factorize_hessian"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.lean_hessian:factorize_hessian",
        "the Cholesky factorization on the column-major view of the one Hessian"),
    "gptq.quantize_weight": Patch(
        ("llmcompressor.modifiers.gptq.base", "quantize_weight"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.lean_hessian:quantize_weight",
        "one float32 copy of the weight: the block error propagated and act-order undone a slab of rows "
        "at a time"),
    "gptq.compress_module_list": Patch(
        ("llmcompressor.modifiers.gptq.base", "GPTQModifier.compress_module_list"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.lean_hessian:one_batch_per_call",
        "one call per batch, so a batch's tensors are freed before the next one is quantized", wraps=True),
    "sequential.disable_offloading": Patch(
        ("llmcompressor.pipelines.sequential.pipeline", "disable_offloading"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.patches:weights_per_forward",
        "with --offload-dir on a CPU, a module's weight read per forward instead of a whole layer held "
        "onloaded (quantkit.engines.llmcompressor.llmc.onloaded_per_forward)"),
    "sequential.resume": Patch(
        ("llmcompressor.pipelines.sequential.pipeline", "SequentialPipeline.__call__"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.layer_resume:resumable_pipeline",
        "--resume: the same layer-by-layer loop, saving each finished layer and the hidden states after it, and "
        "taking them back after an interruption (a copy of the loop: only this version is verified)", wraps=True),
    "gptq.broadcast_qparams_and_cleanup": Patch(
        ("llmcompressor.modifiers.gptq.base", "broadcast_qparams_and_cleanup"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.distributed:broadcast_then_wait",
        "under torchrun, a barrier after the broadcast: nothing waited for the rank writing a CPU weight "
        "(quantkit.engines.llmcompressor.distributed)"),
    "quantization.broadcast_qparams_and_cleanup": Patch(
        ("llmcompressor.modifiers.quantization.quantization.base", "broadcast_qparams_and_cleanup"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.distributed:broadcast_then_wait",
        "under torchrun, a barrier after QuantizationModifier's broadcast of the weight scales: as for GPTQ, "
        "nothing waited for the rank writing a CPU module's scales (quantkit.engines.llmcompressor.distributed)"),
    "awq.apply_smoothing": Patch(
        ("llmcompressor.modifiers.transform.awq.base", "AWQModifier._apply_smoothing"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.one_writer:awq_smoothing_once",
        "under torchrun, every rank wrote the smoothing into the weights the ranks share (on a CPU the smooth layer "
        "was divided once per rank): the smoothing runs on each rank's private copies of the layers it touches "
        "and rank 0 alone writes the shared ones, between two barriers (quantkit.engines.llmcompressor.one_writer)",
        wraps=True),
    "awq.update_offload_parameter": Patch(
        ("llmcompressor.modifiers.transform.awq.base", "update_offload_parameter"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.one_writer:write_once",
        "under torchrun, AWQ's writes of the smoothed weights: the shared copy by rank 0 alone, each rank's "
        "private copy by that rank"),
    "awq.allreduce_data_sum": Patch(
        ("llmcompressor.modifiers.transform.awq.base", "_allreduce_data_sum"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.one_writer:sum_over_ranks",
        "under torchrun without an accelerator (gloo on a CPU), AWQ's statistics and losses summed over the ranks "
        "where they are: 0.14.0.1 moves them to the current accelerator, which raises on a CPU", wraps=True),
    "smoothquant.apply_smoothing": Patch(
        ("llmcompressor.modifiers.transform.smoothquant.base", "SmoothQuantModifier._apply_smoothing"),
        "llmcompressor", LLMCOMPRESSOR, "quantkit.engines.llmcompressor.one_writer:smoothquant_smoothing_once",
        "under torchrun, as AWQ's: every rank read back and wrote the weights the ranks share, so the smoothing "
        "was applied once per rank on a CPU", wraps=True),
    "smoothquant.update_offload_parameter": Patch(
        ("llmcompressor.modifiers.transform.smoothquant.base", "update_offload_parameter"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.one_writer:write_once",
        "under torchrun, SmoothQuant's writes of the smoothed weights: the shared copy by rank 0 alone"),
    "offset_norm.exact_weight": Patch(
        ("llmcompressor.modeling.offset_norm", "CalibrationOffsetNorm.__init__"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.offset_norm:hold_exact",
        "every oneshot swaps Gemma's and Qwen3.5's offset norms (x * (1 + w)) for a stand-in holding 1 + w rounded "
        "to the checkpoint's bf16 and writes weight - 1 back: a |w| < 2^-9 came back as 0 and the small ones lost "
        "their low bits in every calibrated method; the stand-in holds 1 + w in float64 "
        "(quantkit.engines.llmcompressor.offset_norm)", wraps=True),
    "offset_norm.exact_restore": Patch(
        ("llmcompressor.modeling.offset_norm", "CalibrationOffsetNorm.restore"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.offset_norm:restore_exact",
        "with the stand-in's weight in float64 (above), weight - 1 taken in float64: 0.14.0.1 rounds it to float32 "
        "first"),
    "awq.representable_scales": Patch(
        ("llmcompressor.modifiers.transform.awq.base", "AWQModifier._compute_best_scale"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.offset_norm:awq_representable",
        "an offset norm divided by a large AWQ scale stores a factor 1 + w' that bf16 rounds by up to 2^-9 "
        "absolutely (20% at s = 100), while the balance layers took the exact scale: the scales become the ones "
        "the stored norm represents, and the balance layers take those (quantkit.engines.llmcompressor.offset_norm)",
        wraps=True),
    "smoothquant.representable_scales": Patch(
        ("llmcompressor.modifiers.transform.smoothquant.base", "SmoothQuantModifier._calculate_smoothing_scales"),
        "llmcompressor", LLMCOMPRESSOR, "quantkit.engines.llmcompressor.offset_norm:smoothquant_representable",
        "as AWQ's: SmoothQuant's scales for an offset norm made the ones its stored weight represents",
        wraps=True),
    "spinquant.rotation_once": Patch(
        ("llmcompressor.modifiers.transform.spinquant.base", "SpinQuantModifier.on_calibration_start"),
        "llmcompressor", LLMCOMPRESSOR, "quantkit.engines.llmcompressor.one_writer:rotation_once",
        "under torchrun, every rank folded the rotation into the weights the ranks share (on a CPU, once per rank: "
        "nvfp4 with spinquant on 2 gloo ranks came out with KLD 0.61 instead of 5.6e-5): rank 0 alone writes "
        "(the two entries below), and the ranks wait for it (quantkit.engines.llmcompressor.one_writer)",
        wraps=True),
    "quip.rotation_once": Patch(
        ("llmcompressor.modifiers.transform.quip.base", "QuIPModifier.on_calibration_start"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.llmcompressor.one_writer:rotation_once",
        "under torchrun, as SpinQuant's: the Hadamard rotation folded into the weights by rank 0 alone", wraps=True),
    "transform.update_offload_parameter": Patch(
        ("compressed_tensors.transform.factory.base", "update_offload_parameter"), "compressed-tensors",
        COMPRESSED_TENSORS, "quantkit.engines.llmcompressor.one_writer:write_by_source",
        "under torchrun, a rotation folded into an offloaded weight written by rank 0 alone"),
    "fuse.update_offload_parameter": Patch(
        ("llmcompressor.modeling.fuse", "update_offload_parameter"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.llmcompressor.one_writer:write_by_source",
        "under torchrun, SpinQuant's centred embeddings and the norms fused into the next Linears written by rank 0 "
        "alone"),
    "transform.offloaded_device": Patch(
        ("compressed_tensors.transform.factory.hadamard", "get_offloaded_device"), "compressed-tensors",
        COMPRESSED_TENSORS, "quantkit.engines.patches:transform_device",
        "a Hadamard transform of a module offloaded to disk (quantkit's vocabulary tables) is built on the CPU: "
        "compressed-tensors 0.19 moves its matrix to the module's offload device, and torch has no 'disk' "
        "device (SpinQuant's R1 rotates the embeddings and the head)"),
    "awq.pin_memory": Patch(
        ("llmcompressor.pipelines.cache", "IntermediatesCache.pin_memory"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.patches:no_pinning",
        "Tensor.pin_memory() raises without an accelerator; pinning only speeds up host-to-device copies, "
        "which never happen then (quantkit.methods.awq)"),
    "transformers.safe_save_file": Patch(
        ("transformers.modeling_utils", "safe_save_file"), "transformers", TRANSFORMERS,
        "quantkit.io.shards:save_file",
        "save_pretrained's shards written with plain writes: safetensors maps the output file while "
        "filling it, so a whole shard's pages counted in the RSS beside the model"),
    "compressed_tensors.disk_save_file": Patch(
        ("compressed_tensors.offload.cache.disk", "save_file"), "compressed-tensors", COMPRESSED_TENSORS,
        "quantkit.io.shards:save_temporaries",
        "the disk offload's rewrite of each updated weight with plain writes (as above)"),
    "autoround.on_initialize": Patch(
        ("llmcompressor.modifiers.autoround.base", "AutoRoundModifier.on_initialize"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.patches:quantization_params_offloaded",
        "it creates the scales and zero points inside compressed-tensors' disable_onloading (to spare "
        "multi-GPU groups a broadcast), which leaves them in a disk offload cache as tensors the cache "
        "cannot read back (KeyError at the next read): with --offload-dir, in one process, they are "
        "offloaded like every other method's (quantkit.methods.autoround)", wraps=True),
    "autoround.suspend_offloading": Patch(
        ("llmcompressor.modifiers.autoround.base", "suspend_offloading"), "llmcompressor", LLMCOMPRESSOR,
        "quantkit.engines.patches:suspend_offloading_keeping_disk",
        "after tuning a layer it offloads the layer's modules again without the disk cache's folder, which "
        "a disk offload cannot be made without (ValueError): with --offload-dir the folder is passed back; under "
        "torchrun each rank tunes its own copy of the layer's tensors, which it wrote into the ones the ranks share "
        "on a CPU, and rank 0's copy is shared again when the layer is offloaded (one writer)"),
    "autoround.zero_points": Patch(
        ("llmcompressor.modifiers.autoround.base", "AutoRoundModifier._postprocess_qparams"), "llmcompressor",
        LLMCOMPRESSOR, "quantkit.engines.patches:zero_points_kept",
        "it hands AutoRound's scales to the layer but not its zero points (`zp`): an asymmetric layer keeps "
        "the zero points of 0 registered before tuning, and compression clamps every weight AutoRound put "
        "above the signed range (KLD 2x worse than symmetric on a sharpened width-576 model). AutoRound's "
        "zero points are registered instead, moved to compressed-tensors' signed range", wraps=True),
    "autoround.loss_over_ranks": Patch(
        ("auto_round.algorithms.quantization.sign_round.quantizer", "SignRoundQuantizer._get_loss"), "auto-round",
        AUTO_ROUND, "quantkit.engines.llmcompressor.autoround_ranks:loss_over_ranks",
        "under torchrun, each rank kept the iteration with its own lowest loss and stopped early on it: the loss's "
        "value is the ranks' mean (its gradient the rank's own), so every rank keeps the same iteration and stops "
        "together (quantkit.engines.llmcompressor.autoround_ranks)", wraps=True),
    "autoround.gradients_averaged": Patch(
        ("auto_round.algorithms.quantization.sign_round.quantizer", "setup_ddp_if_needed_"), "auto-round", AUTO_ROUND,
        "quantkit.engines.llmcompressor.autoround_ranks:gradients_averaged",
        "under torchrun, the layer's gradients averaged over the ranks before each step instead of a "
        "DistributedDataParallel wrapper, which refuses a CPU module with device_ids=['cpu'] (gloo)", wraps=True),
    "transformers.sklearn": Patch(
        ("transformers.utils", "is_sklearn_available"), "transformers", TRANSFORMERS,
        "quantkit.engines.patches:sklearn_absent",
        "transformers' generation module imports scikit-learn whenever it is installed (lm-eval installs it), "
        "and with it scipy and pandas: about 150 MiB in every process that loads a model, for assisted "
        "generation's roc_curve, which quantkit never runs. Swapped while a command runs, from the moment the "
        "generation module is first imported (patched_on_import: a run that never imports it imports no "
        "transformers), which keeps seeing it absent"),
    "tqdm.init": Patch(
        ("tqdm.std", "tqdm.__init__"), "tqdm", ">=4.60", "quantkit.engines.patches:quiet_tqdm_init",
        "engines' progress bars off where stderr is not a terminal (logs keep one line per phase)", wraps=True),
}

# Attributes quantkit writes on third-party objects: (object, attribute) -> why.
WRITES = {
    ("transformers PreTrainedModel", "_weight_conversions"): (
        "the meta-device model of the model-free fp8 path records the checkpoint renamings it used, as "
        "from_pretrained does, so compressed-tensors' save names tensors as transformers wrote them "
        "(quantkit.engines.llmcompressor.model_free)"),
}


@contextmanager
def weights_per_forward() -> Iterator[None]:
    """disable_offloading that holds nothing onloaded: each module's weight is read for each forward."""
    yield


def transform_device(module, default=None):
    """compressed-tensors' get_offloaded_device for a transform's matrix: the CPU where the module is offloaded
    to disk (its weight is still read and written through the disk offload)."""
    from compressed_tensors.utils import get_offloaded_device

    device = get_offloaded_device(module, default)
    return "cpu" if device == "disk" else device


def sklearn_absent() -> bool:
    """transformers.utils.is_sklearn_available for a quantkit command: no."""
    return False


def no_pinning(self, *args, **kwargs) -> None:
    """IntermediatesCache.pin_memory without an accelerator: nothing to pin for."""


def quantization_params_offloaded(original: Callable) -> Callable:
    """AutoRoundModifier.on_initialize with compressed-tensors' disable_onloading a no-op while it runs
    (it imports the function when called, so only its own use changes)."""
    from contextlib import nullcontext

    def on_initialize(self, *args, **kwargs):
        import llmcompressor.pipelines.sequential.helpers  # noqa: F401 - bound to the original before the swap

        with swapped({("compressed_tensors.offload", "disable_onloading"): nullcontext}):
            return original(self, *args, **kwargs)

    return on_initialize


@contextmanager
def suspend_offloading_keeping_disk(model) -> Iterator[None]:
    """llm-compressor's autoround suspend_offloading (every offloaded module of `model` onloaded for
    AutoRound to place, offloaded again after), with a disk cache's folder passed back on the way out; under
    torchrun each rank tunes its own copies of the layer's tensors (quantkit.engines.llmcompressor.autoround_ranks)."""
    from quantkit.engines.llmcompressor.autoround_ranks import distributed, own_copies
    from compressed_tensors.offload import get_execution_device, get_offloaded_device
    from compressed_tensors.offload.cache.base import OffloadCache
    from compressed_tensors.offload.module import offload_module, remove_module_offload

    suspended = {}
    for name, module in model.named_modules():
        if isinstance(module._parameters, OffloadCache):
            folder = getattr(module._parameters, "offload_dir", None)
            suspended[name] = (get_execution_device(module), get_offloaded_device(module),
                               {"offload_dir": folder} if folder is not None else {})
            remove_module_offload(module, onload_tensors=True)
            if distributed():
                own_copies(module)  # rank 0's copy is shared again when the module is offloaded (one writer)
    yield
    for name, module in model.named_modules():
        if name in suspended:
            onload, offload, extra = suspended[name]
            offload_module(module, onload, offload, **extra)


def zero_points_kept(original: Callable) -> Callable:
    """AutoRoundModifier._postprocess_qparams with each asymmetric layer's zero points taken from AutoRound
    (signed_zero_points) in place of the ones registered before tuning."""

    def postprocess_qparams(self, model, registered):
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            zero_point = getattr(module, "zp", None)
            if scheme is None or scheme.weights is None or scheme.weights.symmetric or zero_point is None:
                continue
            placeholder = registered.get(name, {}).get("weight_zero_point")
            if placeholder is not None:
                signed = signed_zero_points(module.weight, module.scale, zero_point, scheme.weights.num_bits, name)
                registered[name]["weight_zero_point"] = signed.to(placeholder.device, placeholder.dtype).reshape(
                    placeholder.shape)
                del module.zp
        return original(self, model, registered)

    return postprocess_qparams


def signed_zero_points(weight, scale, zero_point, bits: int, name: str = "layer"):
    """AutoRound's zero points moved from its unsigned grid [0, 2^bits - 1] to the signed one compressed-
    tensors rounds to, [-2^(bits-1), 2^(bits-1) - 1]: the same weights, each integer 2^(bits-1) lower.
    Raises InternalError where AutoRound's weight, divided by its scale, does not land on that grid (a
    convention this conversion does not know: writing it would clamp weights silently)."""
    import torch

    half = 2 ** (bits - 1)
    device = weight.device  # AutoRound may keep the scales and zero points apart from the weight (on the CPU)
    signed = torch.as_tensor(zero_point).to(device, torch.float32) - half
    groups = weight.detach().float().reshape(weight.shape[0], scale.shape[-1], -1)
    steps = scale.detach().to(device, torch.float32).reshape(*scale.shape, 1)
    levels = torch.round(groups / steps) + signed.reshape(*scale.shape, 1)
    if levels.min() < -half or levels.max() > half - 1:
        raise InternalError(f"AutoRound left {name} with {bits}-bit levels from {levels.min():.0f} to "
                            f"{levels.max():.0f}, outside compressed-tensors' {-half}..{half - 1}: "
                            "its zero-point convention is not the one quantkit converts")
    return signed


def quiet_tqdm_init(original: Callable) -> Callable:
    """tqdm.__init__ with disable=True forced."""

    def init(self, *args, **kwargs):
        kwargs["disable"] = True
        original.__get__(self, type(self))(*args, **kwargs)  # a function, or tqdm 4.70's partialmethod

    return init


def site_owner(site: Site) -> tuple[Any, str]:
    """The module or class that holds the site's attribute, and the attribute's name."""
    module_name, path = site
    *classes, name = path.split(".")
    owner = importlib.import_module(module_name)
    for class_name in classes:
        owner = vars(owner).get(class_name)
        if not isinstance(owner, type):
            raise AttributeError(f"{module_name}.{path}: {class_name} no longer exists")
    return owner, name


def site_function(site: Site) -> Callable:
    owner, name = site_owner(site)
    function = vars(owner).get(name)
    if not (callable(function) or hasattr(function, "__get__")):  # a function, or a method descriptor
        raise AttributeError(f"{site[0]}.{site[1]} no longer exists")
    return function


def load(reference: str) -> Callable:
    """The function a "module:function" reference names."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def check_version(name: str, patch: Patch) -> None:
    """InternalError when the installed package is outside the versions the patch was verified against."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        installed = version(patch.package)
    except PackageNotFoundError:
        return
    if installed not in SpecifierSet(patch.verified):
        raise InternalError(f"quantkit's patch {name} of {patch.site[0]}.{patch.site[1]} was verified against "
                            f"{patch.package}{patch.verified}; {installed} is installed",
                            hint=f"install {patch.package}{patch.verified} (pyproject.toml pins it)")


def replacement(patch: Patch, original: Callable) -> Callable:
    built = load(patch.replacement)
    return built(original) if patch.wraps else built


def signature_matches(patch: Patch) -> bool:
    """The replacement takes every call the site's function takes: as many positional parameters as it
    has without a default, each parameter with a default under the same name (callers pass those by
    keyword), and a default for anything more (a wrapper is built around the original: always)."""
    if patch.wraps:
        return True
    theirs = list(inspect.signature(site_function(patch.site)).parameters.values())
    mine = list(inspect.signature(load(patch.replacement)).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in mine):
        return True
    required = [p for p in theirs if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in mine}
    keywords = all(p.name in named or any(m.kind is m.VAR_KEYWORD for m in mine)
                   for p in theirs if p.default is not inspect.Parameter.empty)
    extra = [p for p in mine[len(theirs):] if p.kind is not p.VAR_KEYWORD]
    return len(mine) >= len(required) and keywords and all(p.default is not inspect.Parameter.empty for p in extra)


def patched(*names: str):
    """The named PATCHES swapped in while inside, the originals restored on exit."""
    for name in names:
        check_version(name, PATCHES[name])
    return swapped({PATCHES[name].site: replacement(PATCHES[name], site_function(PATCHES[name].site))
                    for name in names})


def patched_with(name: str, **bound: Any):
    """One entry swapped in while inside, its replacement built with the run's values (`bound`, passed to the
    entry's builder after the original; only for entries that wrap)."""
    patch = PATCHES[name]
    if not patch.wraps:
        raise InternalError(f"quantkit's patch {name} takes no bound values", hint="report this as a bug")
    check_version(name, patch)
    return swapped({patch.site: load(patch.replacement)(site_function(patch.site), **bound)})


@contextmanager
def swapped(replacements: dict[Site, Callable]) -> Iterator[None]:
    """Each site's function replaced by its replacement while inside; the originals restored on exit."""
    originals = {site: site_function(site) for site in replacements}
    try:
        for site, function in replacements.items():
            setattr(*site_owner(site), function)
        yield
    finally:
        for site, function in originals.items():
            setattr(*site_owner(site), function)


class ImportTrigger:
    """A sys.meta_path finder that calls `fire` once, just before `module` is first imported, and finds
    nothing itself (the import goes on as usual)."""

    def __init__(self, module: str, fire: Callable[[], None]):
        self.module, self.fire, self.fired = module, fire, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.module and not self.fired:
            self.fired = True
            self.fire()
        return None


@contextmanager
def patched_on_import(name: str, trigger: str) -> Iterator[None]:
    """The named patch swapped in while inside, but only from the moment `trigger` is about to be imported
    (at once if it already is), so that a command which never imports it never imports the patched
    library either; the original restored on exit."""
    import sys
    from contextlib import ExitStack

    with ExitStack() as stack:
        if trigger in sys.modules:
            stack.enter_context(patched(name))
            yield
            return
        hook = ImportTrigger(trigger, lambda: stack.enter_context(patched(name)))
        sys.meta_path.insert(0, hook)
        try:
            yield
        finally:
            sys.meta_path.remove(hook)


def plain_writes():
    """transformers' save_pretrained and compressed-tensors' disk offload write their safetensors files
    with plain writes while inside (quantkit.io.shards.save_file)."""
    return patched("transformers.safe_save_file", "compressed_tensors.disk_save_file")


# every oneshot: offset norms written back as they were, and smoothed through exactly
OFFSET_NORMS = ("offset_norm.exact_weight", "offset_norm.exact_restore", "awq.representable_scales",
                "smoothquant.representable_scales")

LEAN_GPTQ = ("gptq.accumulate_hessian", "gptq.prepare_batch", "gptq.apply_activation_ordering",
             "gptq.factorize_hessian", "gptq.quantize_weight", "gptq.compress_module_list")
