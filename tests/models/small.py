"""Small models for the tests: hand-written ones and transformers models from tiny configs."""

from __future__ import annotations

import torch
import torch.nn as nn

from .examples import MLPChain, ResidualCNN, TinyGPT


def mlp():
    torch.manual_seed(0)
    return MLPChain(d=64, blocks=6), (torch.randn(256, 64),)


def cnn():
    torch.manual_seed(0)
    return ResidualCNN(c=8, blocks=3), (torch.randn(4, 3, 16, 16),)


def tiny_gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, d=64, layers=2, heads=2, seq=32, dropout=0.1)
    return model, (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    return model, {"input_ids": torch.randint(0, 128, (2, 32))}


def hf_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64,
    )
    model = BertModel(cfg)
    ids = torch.randint(0, 128, (2, 32))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hf_vit():
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    cfg = ViTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, image_size=64,
        patch_size=8,
    )
    # sdpa: HF builds an explicit attention mask when traced but not in eager mode, so the
    # captured graph saves 2 more tensors than the eager model; eager attention takes one path.
    cfg._attn_implementation = "eager"
    return ViTModel(cfg), {"pixel_values": torch.randn(8, 3, 64, 64)}


def hf_resnet():
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    return ResNetModel(cfg), {"pixel_values": torch.randn(8, 3, 64, 64)}


class DataDependent(nn.Module):
    """Branches on a tensor's value and returns a data-dependent shape: neither tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            return y[y > 0]
        return y.nonzero()


LOCAL = {"mlp": mlp, "cnn": cnn, "tiny_gpt": tiny_gpt}
HF = {"gpt2": hf_gpt2, "bert": hf_bert, "vit": hf_vit, "resnet": hf_resnet}
ALL = {**LOCAL, **HF}
