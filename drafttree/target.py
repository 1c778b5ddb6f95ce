"""A target model together with its tokenizer and chat template."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .compute import ComputeChoice

if TYPE_CHECKING:
    from .protocols import TargetModel


@dataclass
class Target:
    model: TargetModel  # a drafttree.model CausalLM
    tokenizer: object | None
    name: str
    compute: ComputeChoice | None = None  # the linear layers' path (None: built directly, e.g. in tests)
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        if not self.stop_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.stop_token_ids = (self.tokenizer.eos_token_id,)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} was loaded without tokenizer files; pass token ids instead of text")
        return self.tokenizer

    def encode_chat(self, prompt: str | list[dict], system: str | None = None) -> torch.Tensor:
        """Token ids of a chat prompt (a user message or a list of messages) ready for the assistant's turn. A model
        without a chat template (a base model's GGUF, e.g. Gemma 3 270M) continues the messages' text instead: their
        contents one after another, with the tokenizer's own special tokens (its BOS)."""
        tok = self._need_tokenizer()
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        # A transformers tokenizer says "no template" with chat_template None; one without that attribute (the
        # tests' character tokenizer) brings its own apply_chat_template.
        if hasattr(tok, "chat_template") and not tok.chat_template:
            text = "\n\n".join(str(m["content"]) for m in messages)
            return torch.tensor(tok.encode(text, add_special_tokens=True), dtype=torch.long)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of a plain-text prompt, with the tokenizer's own special tokens (its BOS where the model's
        tokenizer adds one, as llama.cpp does: Gemma 3 without its BOS repeats itself)."""
        return torch.tensor(self._need_tokenizer().encode(text, add_special_tokens=True), dtype=torch.long)

    @property
    def compute_path(self) -> str:
        if self.compute is not None:
            return self.compute.path
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.model.dtype, str(self.model.dtype))

    @property
    def compute_label(self) -> str:
        """e.g. "int8 (avx512_vnni)": what reports print beside their figures."""
        isa = self.compute.isa if self.compute is not None else None
        return f"{self.compute_path} ({isa})" if isa else self.compute_path

    def decode(self, ids) -> str:
        return self._need_tokenizer().decode(list(map(int, ids)), skip_special_tokens=True)
