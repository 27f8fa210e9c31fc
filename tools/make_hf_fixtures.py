"""Write the tiny Hugging Face checkpoints, reference logits and gradients under tests/fixtures/hf/,
with the transformers version of the running interpreter: 4.x writes tests/fixtures/hf/<name>,
5.x writes tests/fixtures/hf/tf5/<name>. Run by hand (not in CI), once per version, in two venvs
(only PyPI is needed; torch's PyPI wheel works on CPU):

    python3.11 -m venv /tmp/venv-tf4
    /tmp/venv-tf4/bin/pip install torch==2.14.1 transformers==4.57.6 safetensors numpy
    python3.11 -m venv /tmp/venv-tf5
    /tmp/venv-tf5/bin/pip install torch==2.14.1 transformers==5.25.0 safetensors numpy
    /tmp/venv-tf4/bin/python tools/make_hf_fixtures.py
    /tmp/venv-tf5/bin/python tools/make_hf_fixtures.py
(`--counts-only`: only param_counts.json and transformers_defaults.json, for a new released config;
`--save-compat`: only save_compat.json, after saved_configs/ changed, in each of 4.57.6, 5.24.0 and
5.25.0.) torch's CPU wheel (2.13.0+cpu, https://download.pytorch.org/whl/cpu) writes the same bits
as the 2.14.1 the 5.24.0 records name (the trajectory records name their torch).

`--chat` writes only the chat-template fixture, tests/fixtures/chat/ (see `chat_fixtures`); it
needs transformers, tokenizers and jinja2, no torch:

    python3.11 -m venv /tmp/venv-chat
    /tmp/venv-chat/bin/pip install transformers==5.25.0 tokenizers jinja2
    /tmp/venv-chat/bin/python tools/make_hf_fixtures.py --chat
(and again with transformers==4.57.6: reference.json holds one entry per version)

`--trajectory` writes only trajectory.json in each tests/fixtures/hf/trajectory/<family>/ (this
version's entry; see `trajectory_run`): the folder's weights, batches and setup.json are
dropless's, written first in the dropless venv (no transformers there):

    PYTHONPATH=src .venv/bin/python -m tests._support.trajectory
    /tmp/venv-tf4/bin/python tools/make_hf_fixtures.py --trajectory
    /tmp/venv-tf5/bin/python tools/make_hf_fixtures.py --trajectory

Each fixture folder holds what `save_pretrained` wrote (config.json, safetensors, maybe an
index), plus
  * `reference.npz`: `tokens` [2, 12], the float32 `logits` transformers computed for them and
    `loss`, the mean next-token cross-entropy of those logits (tokens[:, 1:] from [:, :-1]);
  * `grads.safetensors`: d loss / d every parameter (torch autograd), float16, under the
    checkpoint's own tensor names (the gradients are put in the parameters and written with
    `save_pretrained`, so transformers 5's fused experts come out per expert, as its
    checkpoints do).
Weights are random (seeded), norms and the router bias too, so a mapping mistake shows.
`*_sliding/` folders hold only a config.json (a sliding window, which we refuse).

Also written, merged over the versions run (one entry each):
  * `released/param_counts.json`: transformers' parameter counts (model.parameters(), so
    buffers such as DeepSeek-V3's e_score_correction_bias are not counted) of every
    `released/*/config.json`, built on the meta device (no memory), per transformers version;
  * `transformers_defaults.json`: the class defaults of the config keys dropless reads when a
    config.json leaves them out (dropless.hf.config_formats.DEFAULTS is checked against it);
  * `save_compat.json`: for each config dropless's `hf.save` writes (`saved_configs/`, which
    tests/hf/test_config_formats.py keeps equal to what hf.save writes today), the largest
    logit difference from the reference when this version loads it with the fixture weights.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import transformers

try:   # the checkpoint fixtures need torch; --chat only transformers, tokenizers and jinja2
    import torch
    from safetensors.torch import load_file, save_file
except ImportError:
    torch = None

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
MAJOR = int(transformers.__version__.split(".")[0])
OUT = ROOT if MAJOR < 5 else ROOT / "tf5"
TOKENS = np.random.RandomState(0).randint(0, 256, size=(2, 12))
ARCH_OF = {"DeepseekV3Config": "DeepseekV3ForCausalLM", "MixtralConfig": "MixtralForCausalLM",
           "Qwen3MoeConfig": "Qwen3MoeForCausalLM"}


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:   # norm weights: around 1, not 1, so a misplaced norm shows
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.rand(b.shape, generator=g))


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for `model`, under their checkpoint names."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        out = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out


def reference(model, d: Path) -> None:
    """reference.npz (logits, loss) and grads.safetensors for `model` into folder d."""
    model.eval()
    model.zero_grad()
    logits = model(torch.tensor(TOKENS)).logits.float()
    targets = torch.tensor(TOKENS[:, 1:])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
    loss.backward()
    np.savez(d / "reference.npz", tokens=TOKENS, logits=logits.detach().numpy(),
             loss=np.float64(loss.item()))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = checkpoint_tensors(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    grads = {k: v.to(torch.float16).contiguous() for k, v in grads.items()
             if not k.endswith("e_score_correction_bias")}   # a buffer: no gradient
    save_file(grads, str(d / "grads.safetensors"), metadata={"format": "pt"})


def write(name: str, model, *, shard: str | None = None, extra: dict | None = None) -> Path:
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True, **({"max_shard_size": shard} if shard
                                                         else {}))
    if extra:   # tensors transformers does not model (DeepSeek-V3's MTP layer): one more shard
        save_file(extra, str(d / "mtp.safetensors"), metadata={"format": "pt"})
        idx_path = d / "model.safetensors.index.json"
        idx = json.loads(idx_path.read_text())
        idx["weight_map"].update({k: "mtp.safetensors" for k in extra})
        idx_path.write_text(json.dumps(idx, indent=2))
    reference(model, d)
    return d


def config_only(name: str, cfg) -> None:
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg.architectures = [ARCH_OF[type(cfg).__name__]]
    cfg.save_pretrained(d)


def deepseek_config(**kw) -> transformers.DeepseekV3Config:
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-5,
                max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
                rope_interleave=True, attn_implementation="eager", torch_dtype=torch.float32)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def mtp_tensors(model, cfg, seed: int) -> dict[str, torch.Tensor]:
    """A random DeepSeek-V3 MTP module as the released checkpoints store it (layer L): its
    decoder block taken from a model one layer deeper, saved with this version's names."""
    n = cfg.num_hidden_layers
    deeper = transformers.DeepseekV3ForCausalLM(
        deepseek_config(**{**_ds_overrides(cfg), "num_hidden_layers": n + 1}))
    randomize(deeper, seed)
    pre = f"model.layers.{n}."
    out = {k: v.contiguous() for k, v in checkpoint_tensors(deeper).items() if k.startswith(pre)}
    g = torch.Generator().manual_seed(seed + 1)
    d = cfg.hidden_size
    out[pre + "enorm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    out[pre + "hnorm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    out[pre + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) / math.sqrt(2 * d)
    out[pre + "shared_head.norm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    sd = model.state_dict()
    out[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    out[pre + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    return out


YARN = {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}
DS_YARN = dict(rope_scaling=YARN, num_nextn_predict_layers=1)


def _ds_overrides(cfg) -> dict:
    return DS_YARN if getattr(cfg, "num_nextn_predict_layers", 0) else {}


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block quantization: one float32 scale per 128x128 block, w ~ q * scale_inv."""
    out, inn = w.shape
    bo, bi = math.ceil(out / block), math.ceil(inn / block)
    pad = torch.zeros(bo * block, bi * block)
    pad[:out, :inn] = w
    blocks = pad.view(bo, block, bi, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(bo * block, bi * block)[:out, :inn]
    return q.to(torch.float8_e4m3fn), scale.float()


def fp8_fixture(seed: int) -> None:
    """A DeepSeek-V3 whose matmul weights are FP8 with 128x128 block scales (dims > 128 so
    tensors hold several, partial, blocks); reference logits and gradients from the model
    holding the dequantized weights."""
    cfg = deepseek_config(hidden_size=136, intermediate_size=144, moe_intermediate_size=40,
                          num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1,
                          q_lora_rank=None)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(model, seed)
    tensors, deq = {}, {}
    for k, v in checkpoint_tensors(model).items():
        quantize = (v.ndim == 2 and "embed_tokens" not in k and "lm_head" not in k
                    and not k.endswith("mlp.gate.weight"))
        if quantize:
            q, s = fp8_quantize(v)
            tensors[k], tensors[k + "_scale_inv"] = q, s
            deq[k] = q.float() * torch.repeat_interleave(torch.repeat_interleave(s, 128, 0), 128,
                                                         1)[:v.shape[0], :v.shape[1]]
        else:
            tensors[k] = deq[k] = v
    d = OUT / "deepseek_v3_fp8"
    shutil.rmtree(d, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:   # the dequantized model, loaded as users would
        cfg.save_pretrained(tmp)
        save_file(deq, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(
            tmp, attn_implementation="eager", torch_dtype=torch.float32)
    d.mkdir(parents=True)
    model.save_pretrained(d)   # config.json as this version writes it (weights replaced below)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                   "quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    reference(model, d)


def checkpoints() -> None:
    torch.manual_seed(0)
    # DeepSeek-V3, every feature: YaRN (mscale != mscale_all_dim), interleaved rope, q low-rank,
    # groups, router bias, routed scaling, dense-first layer, an MTP module; sharded + index
    cfg = deepseek_config(**DS_YARN)
    m = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(m, 1)
    write("deepseek_v3_yarn", m, shard="60KB", extra=mtp_tensors(m, cfg, 2))
    # DeepSeek-V3 the other way: full-rank q, no interleave, no groups, no topk renorm, tied
    cfg = deepseek_config(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                          norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=True,
                          first_k_dense_replace=0, num_hidden_layers=2)
    m = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(m, 3)
    m.tie_weights()
    write("deepseek_v3_plain", m)
    fp8_fixture(4)
    # Mixtral: rope_theta 1e6, head_dim 16 != hidden/heads = 8, GQA
    mix = dict(vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
               num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
               attn_implementation="eager", torch_dtype=torch.float32)
    m = transformers.MixtralForCausalLM(transformers.MixtralConfig(sliding_window=None, **mix))
    randomize(m, 5)
    write("mixtral", m, shard="40KB")
    config_only("mixtral_sliding", transformers.MixtralConfig(sliding_window=8, **mix))
    # Qwen3-MoE: layer pattern DMDDDM (sparse step 2, mlp_only [3]), head_dim 12 != 32/4
    qwen = dict(vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                decoder_sparse_step=2, mlp_only_layers=[3], rms_norm_eps=1e-6, rope_theta=1e6,
                attn_implementation="eager", torch_dtype=torch.float32)
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**qwen))
    randomize(m, 6)
    write("qwen3_moe", m)
    config_only("qwen3_moe_sliding", transformers.Qwen3MoeConfig(
        use_sliding_window=True, sliding_window=8, **qwen))


def _merge_json(path: Path, update: dict) -> None:
    old = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in update.items():
        old.setdefault(k, {}).update(v)
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


def released_counts() -> None:
    """transformers' parameter counts of the released configs (meta device: no memory)."""
    out = {}
    for conf_path in sorted((ROOT / "released").glob("*/config.json")):
        conf = json.loads(conf_path.read_text())
        cls = getattr(transformers, conf["architectures"][0])
        config = cls.config_class.from_dict(conf)
        with torch.device("meta"):
            model = cls(config)
        out[conf_path.parent.name] = {transformers.__version__: sum(
            p.numel() for p in model.parameters())}
    _merge_json(ROOT / "released" / "param_counts.json", out)


def class_defaults() -> None:
    import importlib.util   # the one plain-Python module, without importing dropless (jax)
    spec = importlib.util.spec_from_file_location(
        "config_formats", ROOT.parents[2] / "src" / "dropless" / "hf" / "config_formats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = {}
    DEFAULTS = mod.DEFAULTS
    for arch, keys in DEFAULTS.items():
        c = getattr(transformers, arch).config_class()
        got = {k: getattr(c, k, None) for k in keys}
        if "rope_theta" in keys:   # 5.x keeps it in rope_parameters
            got["rope_theta"] = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
        out[arch] = {transformers.__version__: got}
    _merge_json(ROOT / "transformers_defaults.json", out)


def save_compat() -> None:
    """Each config.json dropless's hf.save writes (tests/fixtures/hf/saved_configs, committed by
    tests/hf/test_config_formats.py) loaded by this version with both versions' fixture weights:
    the largest logit difference from the reference goes to save_compat.json."""
    out = {}
    for saved in sorted((ROOT / "saved_configs").glob("*.json")):
        name = saved.stem
        errs = {}
        for tag, folder in (("tf4", ROOT / name), ("tf5", ROOT / "tf5" / name)):
            with tempfile.TemporaryDirectory() as tmp:
                for f in folder.glob("*.safetensors*"):
                    if f.name != "grads.safetensors":
                        shutil.copy(f, tmp)
                shutil.copy(saved, Path(tmp) / "config.json")
                cls = getattr(transformers, json.loads(saved.read_text())["architectures"][0])
                model = cls.from_pretrained(tmp, attn_implementation="eager",
                                            torch_dtype=torch.float32).eval()
                ref = np.load(folder / "reference.npz")
                with torch.no_grad():
                    logits = model(torch.tensor(ref["tokens"])).logits.float().numpy()
                errs[tag] = float(np.abs(logits - ref["logits"]).max())
        out[name] = {transformers.__version__: errs}
        print(f"save_compat {transformers.__version__} {name}: {errs}", file=sys.stderr)
    _merge_json(ROOT / "save_compat.json", out)


CHAT = ROOT.parent / "chat"
# The real templates (tests/fixtures/chat/templates/, verbatim) and the special tokens their
# folders declare; tokenizer_class is the generic one so transformers reads tokenizer.json as is.
CHAT_FOLDERS = {
    # Qwen3's template with {% generation %} around every assistant turn:
    # github.com/HarryMayne/qwen_3_chat_templates all_assistant.jinja @ e775c85
    "qwen3_all_assistant": {"bos_token": None, "eos_token": "<|im_end|>",
                            "pad_token": "<|endoftext|>"},
    # DeepSeek-R1-Distill-Qwen-32B's (a DeepSeek-V3 style template: BOS, <｜User｜>,
    # <｜Assistant｜>): tokenizer_config.json of the hub folder as mirrored at
    # github.com/Evilcarbon/DeepSeek-R1-Distill-Qwen-32B @ 95ed187 (add_bos_token true there:
    # the tokenizer.json below adds BOS, which a rendered chat must not get twice)
    "deepseek_r1_distill": {"bos_token": "<｜begin▁of▁sentence｜>",
                            "eos_token": "<｜end▁of▁sentence｜>",
                            "pad_token": "<｜end▁of▁sentence｜>", "add_bos_token": True,
                            "add_eos_token": False},
}
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
CHAT_ADDED = ["<think>", "</think>"]   # Qwen3's: added tokens that are not special
CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Green, and then red."}],
    [{"role": "user", "content": "naïve café — 中文 🙂\n  indented"},
     {"role": "assistant", "content": "  leading spaces,\ta tab\n"}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "<think>\nlet me add\n</think>\n\nThe answer is 4."}],
    [{"role": "user", "content": "What does <|im_end|> mean in a prompt?"},
     {"role": "assistant", "content": "It ends a turn: <|im_end|>"}],
]


def chat_tokenizer():
    """A small byte-level BPE (Qwen / DeepSeek style) that knows the templates' control tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for chat in CHATS for m in chat] * 30 + [
        "The quick brown fox jumps over the lazy dog.", "You are a helpful assistant."] * 30
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.add_tokens(CHAT_ADDED)
    return tok


def _prefix_spans(hf_tok, chat) -> list[tuple[int, int]]:
    """The assistant turns' characters by prefix rendering (dropless.data.chat_template's method
    for templates without {% generation %}), from transformers' own renderings."""
    full = hf_tok.apply_chat_template(chat, tokenize=False)
    spans = []
    for k, m in enumerate(chat):
        if m["role"] == "assistant":
            before = hf_tok.apply_chat_template(chat[:k], tokenize=False,
                                                add_generation_prompt=True)
            upto = hf_tok.apply_chat_template(chat[:k + 1], tokenize=False)
            assert upto.startswith(before) and full.startswith(upto), (k, chat)
            spans.append((len(before), len(upto)))
    return spans


def chat_fixtures() -> None:
    """tests/fixtures/chat/<name>/: tokenizer.json (trained once, then kept, so every version
    is compared on the same one) and tokenizer_config.json (a template of CHAT_FOLDERS), and
    reference.json's entry for this transformers version: for each of CHATS, its rendering, its
    ids (`apply_chat_template`) and mask: `return_assistant_tokens_mask` for a template with
    {% generation %}, else the prefix method's spans on transformers' renderings, mapped to
    tokens by transformers' offsets and its overlap rule."""
    from tokenizers import processors
    ref_path = CHAT / "reference.json"
    everything = json.loads(ref_path.read_text(encoding="utf-8")) if ref_path.is_file() else {}
    out = {}
    for name, special in CHAT_FOLDERS.items():
        d = CHAT / name
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "tokenizer.json").is_file():
            tok = chat_tokenizer()
            if special.get("add_bos_token"):
                bos = special["bos_token"]
                tok.post_processor = processors.TemplateProcessing(
                    single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
            tok.save(str(d / "tokenizer.json"))
        template = (CHAT / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                  "chat_template": template}
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1,
                                                            ensure_ascii=False) + "\n")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(d))
        cases = []
        for chat in CHATS:
            text = hf_tok.apply_chat_template(chat, tokenize=False)
            if "{% generation %}" in template:
                enc = hf_tok.apply_chat_template(chat, return_assistant_tokens_mask=True,
                                                 return_dict=True)
                ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
            else:
                ids = list(hf_tok.apply_chat_template(chat, return_dict=False))
                enc = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
                assert list(enc["input_ids"]) == ids
                spans = _prefix_spans(hf_tok, chat)
                mask = [int(any(e > s0 and s < e0 for s0, e0 in spans))
                        for s, e in enc["offset_mapping"]]
            cases.append({"messages": chat, "text": text, "ids": ids, "mask": mask})
        out[name] = cases
    everything[transformers.__version__] = out
    ref_path.write_text(json.dumps(dict(sorted(everything.items())), indent=1,
                                   ensure_ascii=False) + "\n")
    print(f"transformers {transformers.__version__}: chat fixtures in {CHAT}", file=sys.stderr)


TRAJECTORY = ROOT / "trajectory"


def trajectory_lr(setup: dict, step: int) -> float:
    """dropless's schedule (train.step.lr_schedule, optax's warmup_cosine_decay_schedule),
    derived here from its definition: linear from 0 to learning_rate over warmup_steps, then a
    cosine to learning_rate * min_lr_ratio at `steps` (lr_decay_steps 0)."""
    peak, warm = setup["learning_rate"], setup["warmup_steps"]
    if step < warm:
        return peak * step / warm
    span = max(setup["steps"], warm + 1) - warm
    cos = 0.5 * (1 + math.cos(math.pi * min(step - warm, span) / span))
    end = peak * setup["min_lr_ratio"]
    return end + (peak - end) * cos


def trajectory_run(d: Path) -> dict:
    """Train the model of folder d (hf.save's initial weights) on its batches.npy with
    torch.optim.AdamW as dropless's trainer does: lr per step from `trajectory_lr`, decay on
    the matrices only (norm weights, 1-D, are not decayed: dropless's mask), global-norm
    clipping at grad_clip (torch.nn.utils.clip_grad_norm_) before the step, loss the mean
    next-token cross-entropy. Every parameter steps every step, as optax's do: one that got no
    gradient (an expert no token reached, transformers 4.x) gets a zero one, not torch's skip.
    Returns the per-step lr, loss, pre-clip gradient norm and whether the step clipped."""
    setup = json.loads((d / "setup.json").read_text())
    windows = torch.tensor(np.load(d / "batches.npy")).long()
    cls = getattr(transformers, json.loads((d / "config.json").read_text())["architectures"][0])
    model, info = cls.from_pretrained(d, attn_implementation="eager", torch_dtype=torch.float32,
                                      output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.endswith("rotary_emb.inv_freq")]
    assert not missing and not info["unexpected_keys"], info   # every weight is the fixture's
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": setup["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(setup["adam_b1"], setup["adam_b2"]),
                            eps=setup["adam_eps"])
    out = {"torch": torch.__version__, "lr": [], "loss": [], "grad_norm": [], "clipped": []}
    for step in range(setup["steps"]):
        opt.zero_grad(set_to_none=True)
        logits = model(windows[step, :, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 windows[step, :, 1:].reshape(-1))
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = float(torch.nn.utils.clip_grad_norm_(params, setup["grad_clip"]))
        lr = trajectory_lr(setup, step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        for k, v in (("lr", lr), ("loss", loss.item()), ("grad_norm", norm),
                     ("clipped", norm > setup["grad_clip"])):
            out[k].append(v)
    assert any(out["clipped"]) and not all(out["clipped"]), out["grad_norm"]   # both kinds
    return out


def trajectory_fixtures() -> None:
    """trajectory.json of every tests/fixtures/hf/trajectory/<family>/: this transformers
    version's entry (`trajectory_run`), the other versions' kept."""
    for d in sorted(p for p in TRAJECTORY.iterdir() if (p / "setup.json").is_file()):
        path = d / "trajectory.json"
        runs = json.loads(path.read_text()) if path.is_file() else {}
        runs[transformers.__version__] = run = trajectory_run(d)
        path.write_text(json.dumps(dict(sorted(runs.items())), indent=1) + "\n")
        print(f"{d.name}: loss {run['loss'][0]:.4f} -> {run['loss'][-1]:.4f}, clipped "
              f"{sum(run['clipped'])}/{len(run['clipped'])} steps", file=sys.stderr)


def main() -> None:
    if "--chat" in sys.argv:
        chat_fixtures()
        return
    if torch is None:
        sys.exit("make_hf_fixtures.py: the checkpoint fixtures need torch and safetensors "
                 "(see the module docstring); --chat needs neither")
    if "--trajectory" in sys.argv:
        trajectory_fixtures()
        return
    if "--save-compat" in sys.argv:
        save_compat()
        print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
              f"{ROOT / 'save_compat.json'}", file=sys.stderr)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if "--counts-only" not in sys.argv:   # only the released configs' counts and the defaults
        checkpoints()
    released_counts()
    class_defaults()
    save_compat()
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: fixtures "
          f"{total / 1e6:.2f} MB in {ROOT}", file=sys.stderr)


if __name__ == "__main__":
    main()
