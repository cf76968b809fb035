"""The models of the trade-off benchmark, at three scales, with the hand-made checkpointing users write today.

Each builder returns a `Case`: the model (train mode, on the device), its
inputs, the exact shapes used, how to checkpoint it per block, and, where the
model is a plain chain of blocks, how to run it through `checkpoint_sequential`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["Case", "MODELS", "UNet"]


@dataclass
class Case:
    name: str
    title: str
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    shapes: dict[str, Any]
    """Exact configuration and input shapes used."""
    per_block: Callable[[nn.Module], nn.Module]
    """Turns a copy of the model into its per-block checkpointed form."""
    per_block_how: str
    sequential: Callable[[nn.Module], tuple[nn.Module, int]] | None = None
    """Copy of the model -> (module running checkpoint_sequential, number of blocks in the chain)."""
    sequential_why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Checkpointed(nn.Module):
    """A block wrapped by hand: torch.utils.checkpoint, non-reentrant."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


class Chain(nn.Module):
    """head(checkpoint_sequential(blocks, sqrt(n) segments, x)) for models that are a chain of blocks."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], head: Callable[[torch.Tensor], Any], key: str) -> None:
        super().__init__()
        self.model, self.blocks, self.head, self.key = model, blocks, head, key
        self.segments = max(1, round(math.sqrt(len(blocks))))

    def forward(self, **inputs):
        h = checkpoint_sequential(self.blocks, self.segments, inputs[self.key], use_reentrant=False)
        return self.head(h)


def _hf_per_block(model: nn.Module) -> nn.Module:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


_HF_HOW = "HF activation_checkpointing_enable (gradient_checkpointing_enable before it), use_reentrant=False: every transformer layer"
_NOT_SEQ = "n/a: the layers take masks / position embeddings besides the hidden state, not a plain chain"

# scale -> sizes; "full" are the real architectures' shapes.
SIZES = {
    "gpt2": {"tiny": dict(layers=2, d=64, heads=2, vocab=256, batch=2, seq=32),
             "cpu": dict(layers=6, d=128, heads=4, vocab=2048, batch=2, seq=128),
             # the shape the overhead gap was first measured on (6 layers x 256, seq 256, batch 4)
             "wide": dict(layers=6, d=256, heads=4, vocab=2048, batch=4, seq=256),
             "full": dict(layers=12, d=768, heads=12, vocab=50257, batch=8, seq=512)},
    "llama": {"tiny": dict(layers=2, d=64, heads=4, kv=2, ffn=172, vocab=256, batch=2, seq=32),
              "cpu": dict(layers=4, d=128, heads=4, kv=2, ffn=344, vocab=2048, batch=2, seq=128),
              "wide": dict(layers=4, d=256, heads=4, kv=2, ffn=688, vocab=2048, batch=4, seq=256),
              "full": dict(layers=8, d=1024, heads=16, kv=4, ffn=2816, vocab=32000, batch=4, seq=1024)},
    "bert": {"tiny": dict(layers=2, d=64, heads=2, ffn=128, vocab=256, batch=2, seq=32),
             "cpu": dict(layers=6, d=128, heads=4, ffn=512, vocab=2048, batch=2, seq=128),
             "full": dict(layers=12, d=768, heads=12, ffn=3072, vocab=30522, batch=8, seq=512)},
    "vit": {"tiny": dict(layers=2, d=64, heads=2, ffn=128, image=32, patch=8, batch=2),
            "cpu": dict(layers=6, d=128, heads=4, ffn=512, image=64, patch=8, batch=4),
            "full": dict(layers=12, d=768, heads=12, ffn=3072, image=224, patch=16, batch=32)},
    "resnet": {"tiny": dict(emb=8, hidden=[16, 32, 64, 128], depths=[1, 1, 1, 1], image=32, batch=2),
               "cpu": dict(emb=16, hidden=[32, 64, 128, 256], depths=[1, 1, 2, 1], image=64, batch=4),
               "full": dict(emb=64, hidden=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], image=224, batch=32)},
    "unet": {"tiny": dict(c=8, depth=3, image=32, batch=2),
             "cpu": dict(c=8, depth=4, image=64, batch=2),
             "full": dict(c=64, depth=4, image=256, batch=8)},
}


def _tokens(s: dict, device) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2(scale: str, device) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    s = SIZES["gpt2"][scale]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=s["layers"], n_embd=s["d"], n_head=s["heads"], vocab_size=s["vocab"],
                     n_positions=max(1024, s["seq"]), use_cache=False)
    return Case("gpt2", "GPT-2-small-shaped (GPT2LMHeadModel, LM loss)", GPT2LMHeadModel(cfg).to(device).train(),
                _tokens(s, device), s, _hf_per_block, _HF_HOW, sequential_why=_NOT_SEQ)


def llama(scale: str, device) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES["llama"][scale]
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["d"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv"], intermediate_size=s["ffn"], vocab_size=s["vocab"],
                      max_position_embeddings=max(2048, s["seq"]), use_cache=False)
    return Case("llama", "Llama-shaped (LlamaForCausalLM, GQA, LM loss)", LlamaForCausalLM(cfg).to(device).train(),
                _tokens(s, device), s, _hf_per_block, _HF_HOW, sequential_why=_NOT_SEQ)


def bert(scale: str, device) -> Case:
    from transformers import BertConfig, BertForMaskedLM

    s = SIZES["bert"][scale]
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=s["layers"], hidden_size=s["d"], num_attention_heads=s["heads"],
                     intermediate_size=s["ffn"], vocab_size=s["vocab"], max_position_embeddings=max(512, s["seq"]))
    inputs = _tokens(s, device)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return Case("bert", "BERT-base-shaped (BertForMaskedLM, MLM loss on every token)",
                BertForMaskedLM(cfg).to(device).train(), inputs, s, _hf_per_block, _HF_HOW, sequential_why=_NOT_SEQ)


def vit(scale: str, device) -> Case:
    from transformers import ViTConfig, ViTModel

    s = SIZES["vit"][scale]
    torch.manual_seed(0)
    cfg = ViTConfig(num_hidden_layers=s["layers"], hidden_size=s["d"], num_attention_heads=s["heads"],
                    intermediate_size=s["ffn"], image_size=s["image"], patch_size=s["patch"])

    def chain(m: nn.Module) -> tuple[nn.Module, int]:
        blocks = [m.embeddings, *m.layers, m.layernorm]
        return Chain(m, blocks, lambda h: (h, m.pooler(h)), "pixel_values"), len(blocks)

    return Case("vit", "ViT-B-shaped (ViTModel, loss = sum of outputs)", ViTModel(cfg).to(device).train(),
                {"pixel_values": torch.randn(s["batch"], 3, s["image"], s["image"], device=device)}, s,
                _hf_per_block, _HF_HOW, sequential=chain)


def resnet(scale: str, device) -> Case:
    from transformers import ResNetConfig, ResNetModel

    s = SIZES["resnet"][scale]
    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=s["emb"], hidden_sizes=s["hidden"], depths=s["depths"], layer_type="bottleneck")

    def per_stage(m: nn.Module) -> nn.Module:
        for i, stage in enumerate(m.encoder.stages):
            m.encoder.stages[i] = Checkpointed(stage)
        return m

    def chain(m: nn.Module) -> tuple[nn.Module, int]:
        blocks = [m.embedder] + [layer for stage in m.encoder.stages for layer in stage.layers]
        return Chain(m, blocks, lambda h: (h, m.pooler(h)), "pixel_values"), len(blocks)

    return Case("resnet", "ResNet-50-shaped CNN (transformers ResNetModel, bottleneck, BatchNorm)",
                ResNetModel(cfg).to(device).train(),
                {"pixel_values": torch.randn(s["batch"], 3, s["image"], s["image"], device=device)}, s,
                per_stage, "each ResNetStage wrapped by hand in torch.utils.checkpoint (non-reentrant)", sequential=chain)


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """U-Net: `depth` down blocks whose outputs are concatenated into the matching up blocks (long skips)."""

    def __init__(self, c: int = 16, depth: int = 4, cin: int = 3, cout: int = 3) -> None:
        super().__init__()
        chans = [c * 2**i for i in range(depth + 1)]  # channels per level
        self.down = nn.ModuleList([ConvBlock(cin if i == 0 else chans[i - 1], chans[i]) for i in range(depth)])
        self.mid = ConvBlock(chans[depth - 1], chans[depth])
        self.upsample = nn.ModuleList([nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in range(depth)])
        self.up = nn.ModuleList([ConvBlock(2 * chans[i], chans[i]) for i in range(depth)])
        self.head = nn.Conv2d(c, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)  # [B, C_i, H/2^i, W/2^i]
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.mid(x)
        for i in reversed(range(len(self.up))):
            x = self.up[i](torch.cat([self.upsample[i](x), skips[i]], dim=1))
        return self.head(x)


def unet(scale: str, device) -> Case:
    s = SIZES["unet"][scale]
    torch.manual_seed(0)

    def per_block(m: UNet) -> nn.Module:
        for blocks in (m.down, m.up):
            for i, b in enumerate(blocks):
                blocks[i] = Checkpointed(b)
        m.mid = Checkpointed(m.mid)
        return m

    return Case("unet", "U-Net with long skips (GroupNorm, SiLU; loss = sum of output)",
                UNet(s["c"], s["depth"]).to(device).train(),
                {"x": torch.randn(s["batch"], 3, s["image"], s["image"], device=device)}, s, per_block,
                "each down/mid/up ConvBlock wrapped by hand in torch.utils.checkpoint (non-reentrant)",
                sequential_why="n/a: long skips, not a chain")


MODELS: dict[str, Callable[[str, Any], Case]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet, "unet": unet,
}
