"""The conformance matrix's architectures: tiny configs, random weights, no downloads.

Each builder returns (model, example_inputs) in training mode; `build(name)` seeds first, so two calls
build the same weights and inputs. The twelve of tests/models/zoo.py are reused as they are. Families:
causal LMs, masked LMs, seq2seq, vision, audio, MoE, state-space, torchvision-style CNNs (hand-written:
in-place ReLU after BatchNorm, `+=` on residuals), a diffusion-style U-Net, a weight-tied autoencoder,
an LSTM LM and a model built of custom `autograd.Function`s.

HELD_OUT names the architectures kept out of the planner's tuning: none of them appears in the test
suite, the developers' zoo or an earlier review's sweep, so their rows say how the tool does on a model
nobody looked at while changing it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import zoo

__all__ = ["MODELS", "FAMILY", "HELD_OUT", "build"]

VOCAB = 128


def _ids(batch: int = 2, seq: int = 32, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def _lm(cls_name: str, cfg_name: str, **cfg) -> tuple[nn.Module, dict]:
    """A transformers causal LM from a tiny config, with labels (the loss in the step)."""
    import transformers

    config = getattr(transformers, cfg_name)(vocab_size=VOCAB, use_cache=False, **cfg)
    ids = _ids()
    return getattr(transformers, cls_name)(config), {"input_ids": ids, "labels": ids}


def mistral():
    return _lm("MistralForCausalLM", "MistralConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


def qwen2():
    return _lm("Qwen2ForCausalLM", "Qwen2Config", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


def phi():
    return _lm("PhiForCausalLM", "PhiConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=64)


def gpt_neox():
    return _lm("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=64)


def bloom():
    return _lm("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=64, n_head=4)


def opt():
    return _lm("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=64)


def falcon():
    return _lm("FalconForCausalLM", "FalconConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)


def gptj():
    return _lm("GPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64)


def gemma():
    return _lm("GemmaForCausalLM", "GemmaConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16, intermediate_size=128, max_position_embeddings=64)


def stablelm():
    return _lm("StableLmForCausalLM", "StableLmConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


def codegen():
    return _lm("CodeGenForCausalLM", "CodeGenConfig", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64,
               n_ctx=64)


def mamba():
    return _lm("MambaForCausalLM", "MambaConfig", num_hidden_layers=2, hidden_size=32, state_size=8,
               expand=2, conv_kernel=4)


def _mlm(cls_name: str, cfg_name: str, **cfg) -> tuple[nn.Module, dict]:
    """A transformers masked LM with an attention mask (one padded sequence) and labels."""
    import transformers

    config = getattr(transformers, cfg_name)(vocab_size=VOCAB, **cfg)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0
    labels = ids.clone()
    labels[:, ::3] = -100  # unscored positions, as a masked-LM collator leaves them
    return getattr(transformers, cls_name)(config), {"input_ids": ids, "attention_mask": mask, "labels": labels}


_ENC = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)


def roberta():
    return _mlm("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1, **_ENC)


def electra():
    import transformers

    cfg = transformers.ElectraConfig(vocab_size=VOCAB, embedding_size=32, **_ENC)
    ids = _ids()
    # the replaced-token loss indexes the logits with a boolean mask of the attention mask
    return transformers.ElectraForPreTraining(cfg), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids % 2}


def deberta_v2():
    return _mlm("DebertaV2ForMaskedLM", "DebertaV2Config", **_ENC)


def albert():
    return _mlm("AlbertForMaskedLM", "AlbertConfig", embedding_size=32, **_ENC)


def distilbert():
    return _mlm("DistilBertForMaskedLM", "DistilBertConfig", n_layers=2, dim=64, n_heads=4, hidden_dim=128,
                max_position_embeddings=64)


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                     use_cache=False)
    return BartForConditionalGeneration(cfg), {"input_ids": _ids(2, 24), "labels": _ids(2, 16)}


def segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                          decoder_hidden_size=32, num_labels=4)
    return SegformerForSemanticSegmentation(cfg), {
        "pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 4, (4, 32, 32))}


def dinov2():
    from transformers import Dinov2Config, Dinov2Model

    cfg = Dinov2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, image_size=32, patch_size=4)
    return Dinov2Model(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def beit():
    from transformers import BeitConfig, BeitForImageClassification

    cfg = BeitConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     image_size=32, patch_size=4, num_labels=4, use_relative_position_bias=True)
    return BeitForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 3])}


def mobilevit():
    from transformers import MobileViTConfig, MobileViTForImageClassification

    cfg = MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16,
                          24, 24, 48], num_attention_heads=2, num_labels=4)
    return MobileViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def _speech(cls_name: str, cfg_name: str):
    import transformers

    cfg = getattr(transformers, cfg_name)(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=20, pad_token_id=0, ctc_loss_reduction="mean", mask_time_prob=0.0, layerdrop=0.0)
    return getattr(transformers, cls_name)(cfg), {"input_values": torch.randn(2, 800),
                                                   "labels": torch.randint(1, 20, (2, 6))}


def wav2vec2():
    return _speech("Wav2Vec2ForCTC", "Wav2Vec2Config")


def hubert():
    return _speech("HubertForCTC", "HubertConfig")


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU(inplace)-conv-BN, `out += identity`, in-place ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TVResNet(nn.Module):
    def __init__(self, widths=(16, 32), blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1, ReLU6(inplace), a residual where shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class TVMobileNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        cfg = [(16, 1), (16, 1), (24, 2), (24, 1), (32, 2), (32, 1)]
        layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True)]
        cin = 16
        for cout, stride in cfg:
            layers.append(InvertedResidual(cin, cout, stride))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(cin, classes))

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class TVVGG(nn.Module):
    """VGG-style: conv-BN-ReLU(inplace) stacks, max pools, a classifier with in-place ReLU and dropout."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        layers, cin = [], 3
        for v in (16, 16, "M", 32, 32, "M", 64, "M"):
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(cin * 16, 64), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                        nn.Linear(64, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def tv_resnet():
    return TVResNet(), (torch.randn(4, 3, 32, 32),)


def tv_mobilenet():
    return TVMobileNet(), (torch.randn(4, 3, 32, 32),)


def tv_vgg():
    return TVVGG(), (torch.randn(4, 3, 32, 32),)


class ResBlockT(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm, SiLU, a timestep embedding added per channel."""

    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.n2, self.c2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.drop = nn.Dropout(0.1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(F.silu(t))[:, :, None, None]  # [B, C] -> [B, C, 1, 1]
        h = self.c2(self.drop(F.silu(self.n2(h))))
        return h + self.skip(x)


class DiffusionUNet(nn.Module):
    """A DDPM-style U-Net: sinusoidal timestep embedding, residual blocks, self-attention at the bottom,
    long skips concatenated in the decoder, MSE against the noise."""

    def __init__(self, c: int = 16, temb: int = 32) -> None:
        super().__init__()
        self.temb = temb
        self.tmlp = nn.Sequential(nn.Linear(temb, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.d1, self.d2 = ResBlockT(c, c, temb), ResBlockT(c, 2 * c, temb)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid = ResBlockT(2 * c, 2 * c, temb)
        self.attn = nn.MultiheadAttention(2 * c, 2, batch_first=True)
        self.up = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.u1 = ResBlockT(3 * c, c, temb)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def embed(self, t):
        half, dtype = self.temb // 2, self.tmlp[0].weight.dtype  # the model's dtype: it may run in bf16
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32, device=t.device) * (9.21 / half))
        angles = (t.float()[:, None] * freqs[None]).to(dtype)
        return self.tmlp(torch.cat([angles.sin(), angles.cos()], dim=1))

    def forward(self, x, t, noise):
        e = self.embed(t)
        h1 = self.d1(self.inp(x), e)  # [B, c, H, W], kept for the decoder
        h = self.mid(self.d2(self.down(h1), e), e)  # [B, 2c, H/2, W/2]
        b, ch, hh, ww = h.shape
        seq = h.flatten(2).transpose(1, 2)  # [B, HW/4, 2c]
        seq = seq + self.attn(seq, seq, seq, need_weights=False)[0]
        h = seq.transpose(1, 2).reshape(b, ch, hh, ww)
        h = self.u1(torch.cat([self.up(h), h1], dim=1), e)
        return F.mse_loss(self.out(h), noise)


def diffusion_unet():
    return DiffusionUNet(), (torch.randn(4, 3, 16, 16), torch.randint(0, 1000, (4,)), torch.randn(4, 3, 16, 16))


class TiedAutoencoder(nn.Module):
    """An encoder of Linear layers and a decoder that runs their weights transposed back up."""

    def __init__(self, dims=(128, 128, 128, 96, 64)) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dec_bias = nn.ParameterList(nn.Parameter(torch.zeros(a)) for a in dims[:-1])

    def forward(self, x):
        h = x
        for layer in self.enc:
            h = F.gelu(layer(h))
        for i in reversed(range(len(self.enc))):
            h = F.linear(h, self.enc[i].weight.t(), self.dec_bias[i])
            if i:
                h = F.gelu(h)
        return F.mse_loss(h, x)


def tied_autoencoder():
    return TiedAutoencoder(), (torch.randn(512, 128),)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, vocab))

    def forward(self, ids, targets):
        h, _ = self.lstm(self.emb(ids))
        logits = self.head(h)  # [B, T, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lstm_lm():
    return LSTMLM(), (torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32)))


class _ScaledGelu(torch.autograd.Function):
    """gelu(x) * s with a hand-written backward (saves x only)."""

    @staticmethod
    def forward(ctx, x, s: float):
        ctx.save_for_backward(x)
        ctx.s = s
        return F.gelu(x) * s

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
        pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
        return g * ctx.s * (cdf + x * pdf), None


class _RowNorm(torch.autograd.Function):
    """x / ||x|| per row, saving the output and the norm."""

    @staticmethod
    def forward(ctx, x):
        n = x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        y = x / n
        ctx.save_for_backward(y, n)
        return y

    @staticmethod
    def backward(ctx, g):
        y, n = ctx.saved_tensors
        return (g - y * (g * y).sum(-1, keepdim=True)) / n


class CustomFunctions(nn.Module):
    """An MLP whose activation and normalization are custom autograd Functions."""

    def __init__(self, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for fc in self.fc:
            x = x + _RowNorm.apply(_ScaledGelu.apply(fc(x), 1.5))
        return self.head(x)


def custom_function():
    return CustomFunctions(), (torch.randn(256, 64),)


def tiny_gpt():
    from tests.models.examples import TinyGPT

    return TinyGPT(vocab=128, d=64, layers=2, heads=2, seq=32, dropout=0.1), (_ids(4, 32), _ids(4, 32))


MODELS: dict[str, Callable[[], tuple[nn.Module, object]]] = {
    # causal LMs
    "gpt2": zoo.gpt2, "llama": zoo.llama, "mistral": mistral, "qwen2": qwen2, "phi": phi, "gpt_neox": gpt_neox,
    "bloom": bloom, "opt": opt, "falcon": falcon, "gptj": gptj, "gemma": gemma, "stablelm": stablelm,
    "codegen": codegen, "tiny_gpt": tiny_gpt,
    # masked LMs and encoders
    "bert": zoo.bert, "roberta": roberta, "electra": electra, "deberta_v2": deberta_v2, "albert": albert,
    "distilbert": distilbert,
    # seq2seq
    "t5": zoo.t5, "bart": bart, "whisper": zoo.whisper,
    # vision
    "vit": zoo.vit, "swin": zoo.swin, "convnext": zoo.convnext, "resnet": zoo.resnet, "segformer": segformer,
    "dinov2": dinov2, "beit": beit, "mobilevit": mobilevit,
    # audio
    "wav2vec2": wav2vec2, "hubert": hubert,
    # MoE and state-space
    "mixtral": zoo.mixtral, "qwen2_moe": zoo.qwen2_moe, "mamba": mamba,
    # hand-written
    "tv_resnet": tv_resnet, "tv_mobilenet": tv_mobilenet, "tv_vgg": tv_vgg, "unet": zoo.unet,
    "diffusion_unet": diffusion_unet, "tied_autoencoder": tied_autoencoder, "lstm_lm": lstm_lm,
    "custom_function": custom_function,
}

FAMILY = {
    **dict.fromkeys(["gpt2", "llama", "mistral", "qwen2", "phi", "gpt_neox", "bloom", "opt", "falcon", "gptj",
                     "gemma", "stablelm", "codegen", "tiny_gpt"], "causal LM"),
    **dict.fromkeys(["bert", "roberta", "electra", "deberta_v2", "albert", "distilbert"], "masked LM"),
    **dict.fromkeys(["t5", "bart", "whisper"], "seq2seq"),
    **dict.fromkeys(["vit", "swin", "convnext", "resnet", "segformer", "dinov2", "beit", "mobilevit"], "vision"),
    **dict.fromkeys(["wav2vec2", "hubert"], "audio"),
    **dict.fromkeys(["mixtral", "qwen2_moe"], "MoE"),
    "mamba": "state-space",
    **dict.fromkeys(["tv_resnet", "tv_mobilenet", "tv_vgg"], "CNN (torchvision style)"),
    "unet": "U-Net", "diffusion_unet": "diffusion U-Net", "tied_autoencoder": "tied autoencoder",
    "lstm_lm": "LSTM", "custom_function": "custom autograd.Function",
}

HELD_OUT = frozenset({"gemma", "stablelm", "codegen", "gptj", "deberta_v2", "distilbert", "albert", "bart",
                      "beit", "dinov2", "mobilevit", "mamba", "tv_mobilenet", "tv_vgg", "diffusion_unet"})


def build(name: str) -> tuple[nn.Module, object]:
    """The named model (seeded, training mode) and its example inputs."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.train()
    return model, inputs
