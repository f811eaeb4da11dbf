"""Building one stage without ever holding the full model, from a Hub id, a folder, a config or a model.

The model is built on the meta device, split, and only this process's stage is materialised: filled from the
checkpoint's safetensors files (only its own tensors are read) or initialised with the model's own
initialisation. Non-persistent buffers (rotary frequencies, Gemma's embedding scale), which no checkpoint
holds, are computed by the model's own ``_init_weights``, as ``from_pretrained`` computes them.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from hf_noloco.engine.partition import split_model
from hf_noloco.engine.stage import TIED_COPY, TIED_SOURCE, PipelineStage, ties_embeddings
from hf_noloco.rules import looks_like_local_path


def build_stage(
    config: PretrainedConfig,
    stage_index: int,
    num_stages: int,
    stage_boundaries: Sequence[int] | None = None,
    checkpoint: str | os.PathLike | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    stage_balance: str = "layers",
    seed: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PipelineStage:
    """Builds one stage without ever holding the full model: the model is built on the meta device (with
    ``dtype`` weights and ``attn_implementation``, transformers' default when ``None``), the stage is
    materialised on ``device``, then filled from ``checkpoint`` (a folder of safetensors files) or initialised
    with the model's own initialisation (``_init_weights``).

    A fresh initialisation draws each module's weights from a generator seeded by ``seed`` (default:
    ``torch.initial_seed()``) and the module's name, so every split of the model, ``pipeline_stages=1``
    included, starts from the same weights, and runs with different splits can be compared. The global
    random state is left as it was. A tied embedding matrix is initialised as the embeddings are, on the
    first stage and on the last alike."""
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, **extra
        )
    stage = split_model(meta_model, stage_index, num_stages, stage_boundaries, stage_balance)
    stage.to_empty(device=device)
    tied = ties_embeddings(meta_model.config)
    if tied and stage.is_first and stage.is_last:
        stage.lm_head.weight = stage.model.embed_tokens.weight  # to_empty gave the two names two tensors
    # Rotary buffers are computed, not stored: rebuild them on the real device.
    with torch.device(device):
        stage.model.rotary_emb = type(meta_model.model.rotary_emb)(config=meta_model.config)
    if checkpoint is not None:
        load_stage_weights(stage, checkpoint)
        compute_missing_buffers(stage, meta_model)
    else:
        base_seed = torch.initial_seed() if seed is None else seed
        device = torch.device(device)
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], device_type=device.type
        ):
            for name, module in stage.named_modules():
                if tied and name == "lm_head":
                    continue  # the tied weight is initialised as the embeddings, below or by its own name
                torch.manual_seed(module_seed(base_seed, name))
                meta_model._init_weights(module)
            if tied and stage.is_last and not stage.is_first:
                # The last stage's copy: the embeddings' initialisation, drawn from the embeddings' seed.
                embedding = meta_model.model.embed_tokens  # a meta module of the throwaway model
                embedding.weight = stage.lm_head.weight
                torch.manual_seed(module_seed(base_seed, "model.embed_tokens"))
                meta_model._init_weights(embedding)
    return stage


def module_seed(seed: int, module_name: str) -> int:
    """The seed of one module's initialisation: a function of the run's seed and the module's name only."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % 2**63


def _safetensors_files(checkpoint: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: file}`` for a folder holding ``model.safetensors`` or a sharded index."""
    folder = os.fspath(checkpoint)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"No model.safetensors or model.safetensors.index.json in {folder}: hf_noloco loads safetensors "
        "checkpoints only (re-save the model with `save_pretrained`)."
    )


def load_stage_weights(stage: PipelineStage, checkpoint: str | os.PathLike) -> None:
    """Reads only this stage's tensors from a safetensors checkpoint into ``stage``."""
    from safetensors import safe_open

    files = _safetensors_files(checkpoint)
    wanted = stage.state_dict()
    by_file: dict[str, list[str]] = {}
    tied = ties_embeddings(stage.config)
    for name in wanted:
        source = name
        if name == TIED_COPY and (tied or name not in files):
            source = TIED_SOURCE  # a tied model's lm_head is its embeddings (HF ties them the same way)
        if source not in files:
            raise ValueError(
                f"{os.fspath(checkpoint)} holds no tensor {name}, which this stage of a "
                f"{stage.config.model_type} model needs: the checkpoint was saved in another layout "
                "(transformers converts some families' checkpoints, mixture-of-experts among them, when it "
                "loads them, and hf_noloco reads the tensors by name)."
            )
        by_file.setdefault(files[source], []).append((name, source))
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, source in names:
                    wanted[name].copy_(f.get_tensor(source))
                    wanted[name]._is_hf_initialized = True  # loaded: compute_missing_buffers leaves it alone


def compute_missing_buffers(module: nn.Module, model: PreTrainedModel) -> None:
    """Fills what no checkpoint holds (non-persistent buffers such as Gemma's embedding scale) with
    ``model``'s own ``_init_weights``, which, as in ``from_pretrained``, leaves every tensor flagged
    ``_is_hf_initialized`` (the loaded ones) untouched. Meta buffers are first materialised on the CPU."""
    for sub in module.modules():
        names = getattr(sub, "_non_persistent_buffers_set", set())
        if not names:
            continue
        for name in names:
            buffer = sub._buffers.get(name)
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device="cpu")
        for p in sub.parameters(recurse=False):
            p._is_hf_initialized = True
        model._init_weights(sub)


def resolve_checkpoint(
    model_name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> str:
    """A local folder for ``model_name_or_path``: itself, or the Hub snapshot (at ``revision``) of its config,
    weights, generation config and tokenizer files, plus its Python files when ``trust_remote_code``."""
    if looks_like_local_path(model_name_or_path) and not os.path.isdir(model_name_or_path):
        raise ValueError(
            f"model_name_or_path: no such folder {model_name_or_path!r} (a path that looks local is never "
            "looked up on the Hub)."
        )
    if os.path.isdir(model_name_or_path):
        if revision is not None:
            raise ValueError(
                f"model_revision={revision!r} applies to Hub models, but {model_name_or_path!r} is a local "
                "folder: check out the revision there instead."
            )
        return model_name_or_path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.py"] if trust_remote_code else [])
    return snapshot_download(model_name_or_path, revision=revision, allow_patterns=patterns)


def check_model_folder(folder: str, what: str = "model_name_or_path") -> None:
    """A model folder this package can read: a ``config.json`` that is a JSON object, and safetensors weights
    whose headers read (each file's header is read, not its tensors). Raises ``ValueError`` naming the file
    and the cause."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"{what}: {folder!r} holds no config.json (not a Hugging Face model folder).")
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: {config} is not valid JSON ({exc}).") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{what}: {config} holds no model_type (not a model's config).")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{what}: {index} is not a valid index ({type(exc).__name__}).") from None
    else:
        files = ["model.safetensors"] if os.path.isfile(os.path.join(folder, "model.safetensors")) else []
    if not files:
        raise ValueError(
            f"{what}: no model.safetensors or model.safetensors.index.json in {folder}: hf_noloco loads "
            "safetensors checkpoints only (re-save the model with `save_pretrained`)."
        )
    from safetensors import safe_open

    for name in files:
        path = os.path.join(folder, name)
        if os.path.dirname(os.path.normpath(name)) or not os.path.isfile(path):
            raise ValueError(f"{what}: {index} names {name!r}, which is not a file of {folder}.")
        try:
            with safe_open(path, framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise ValueError(
                f"{what}: {path} is not a readable safetensors file ({type(exc).__name__}: {first})."
            ) from None


def weights_dtype(name: str | None, config: PretrainedConfig) -> torch.dtype:
    """The torch dtype of ``model_init_kwargs["dtype"]``: float32 by default, ``"auto"`` the checkpoint's own
    (``config.dtype``, float32 when it names none)."""
    if name is None:
        return torch.float32
    if name == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved.removeprefix("torch."), None)
        return saved if saved in (torch.float32, torch.bfloat16) else torch.float32
    return getattr(torch, name)


def load_config(model_name_or_path: str, **overrides) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_name_or_path, **overrides)


@dataclass
class BuiltStage:
    """What building a stage found out: the stage, and what the export carries from its source."""

    stage: PipelineStage
    folder: str | None = None  # a fine-tuned checkpoint's files (its card, its license)
    generation_config: GenerationConfig | None = None
    base_model: str | None = None  # the Hub id or folder it came from (the card's base_model)
    export_config: PretrainedConfig | None = None  # its config as built (before the Trainer changes it)
    weights_dtype: torch.dtype = torch.float32  # what the model was asked in: the export's too

    def __post_init__(self):
        self.export_config = copy.deepcopy(self.stage.config)
        self.weights_dtype = next(self.stage.parameters()).dtype


def stage_from_source(
    model: str | PretrainedConfig | PreTrainedModel,
    stage_index: int,
    num_stages: int,
    device: torch.device,
    stage_boundaries: Sequence[int] | None,
    stage_balance: str,
    seed: int,
    model_init_kwargs: dict | None = None,
    check: Callable[[PretrainedConfig], None] | None = None,
) -> BuiltStage:
    """This process's stage of ``model``: a Hub id or local folder (fine-tuning: only the stage's tensors are
    read), a ``PretrainedConfig`` (from scratch: built on the meta device, the stage initialised with
    ``seed``) or a model instance (split in memory). ``model_init_kwargs`` as :class:`~hf_noloco.NoLoCoConfig`
    holds them (not for an instance, which is already built)."""
    if isinstance(model, PreTrainedModel):
        if model_init_kwargs:
            raise ValueError(
                "model_init_kwargs only applies when the model is given as a Hub id, a folder or a config; "
                "this model is already built: set its dtype and attention implementation on it directly."
            )
        if check is not None:
            check(model.config)
        stage = split_model(model, stage_index, num_stages, stage_boundaries, stage_balance).to(device)
        generation = getattr(model, "generation_config", None)
        return BuiltStage(stage, None, generation, getattr(model.config, "name_or_path", None) or None)
    init = model_init_kwargs or {}
    trust = init.get("trust_remote_code", False)
    folder = generation = None
    if isinstance(model, str):
        folder = resolve_checkpoint(model, init.get("revision"), trust)
        check_model_folder(folder)
        config = load_config(folder, trust_remote_code=trust)
        if os.path.exists(os.path.join(folder, "generation_config.json")):
            generation = GenerationConfig.from_pretrained(folder)
    elif isinstance(model, PretrainedConfig):
        if init.get("revision") is not None:
            raise ValueError("model_revision applies to a Hub model, not to a config built in Python.")
        config = model  # replica 0's initialisation is broadcast to the others
    else:
        raise TypeError(
            "model must be a Hub id or folder, a PretrainedConfig or a PreTrainedModel, got "
            f"{type(model).__name__}."
        )
    if check is not None:
        check(config)
    stage = build_stage(
        config,
        stage_index,
        num_stages,
        stage_boundaries,
        folder,
        device,
        dtype=weights_dtype(init.get("dtype"), config),
        stage_balance=stage_balance,
        seed=seed,
        attn_implementation=init.get("attn_implementation"),
        trust_remote_code=trust,
    )
    return BuiltStage(stage, folder, generation, model if isinstance(model, str) else None)


def keep_float32_masters(stage: nn.Module) -> bool:
    """Holds the stage's trained bf16 weights in float32 (``master_weights="float32"``: the optimizer then
    steps float32 masters, the forward computes in bf16 under autocast); frozen ones stay bf16. Returns
    whether there were any."""
    trained = [p for p in stage.parameters() if p.requires_grad and p.dtype == torch.bfloat16]
    with torch.no_grad():
        for p in trained:
            p.data = p.data.float()
    return bool(trained)
