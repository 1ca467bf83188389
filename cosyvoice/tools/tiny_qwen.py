"""The tiny bundle's ``CosyVoice-BlankEN`` folder: a byte-level BPE tokenizer trained on a small English and
Chinese corpus with Qwen2's pre-tokenisation and special ids, and the folder's JSON files as the released one
has them (:mod:`cosyvoice.tools.make_tiny_bundle` writes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from cosyvoice.frontend.tokenizer import QWEN2_SPLIT_PATTERN

if TYPE_CHECKING:
    from cosyvoice.tools.make_tiny_bundle import TinyDims

QWEN_VOCAB = 151936  # the embedding keeps the real Qwen2 row count so text-token ids are the real ones
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIRST_SPECIAL_ID = 151643

_CORPUS_EN = (
    "Hello, this is a short prompt for testing.",
    "The little robot read every word aloud, slowly and clearly.",
    "We measured the latency of each chunk twice, then once more at night.",
    "Please speak a bit faster, and keep a cheerful tone!",
    "On March 3rd, 2025, the train left at 7:45 a.m. and cost $12.50.",
    "She asked: \"Is the weather going to be nice tomorrow?\"",
    "Numbers like 42, 3.14 and 1,000,000 should be read naturally.",
    "A quiet voice can still carry a strong message across the room.",
    "Streaming synthesis returns audio while the model keeps thinking.",
    "They're sure it'll work, and we've checked what I'd missed.",
    "Good morning everyone; today we test a tiny speech model.",
    "Read the sentence again, but this time with a gentle smile.",
)
_CORPUS_ZH = (
    "你好，欢迎使用语音合成测试。",
    "今天天气很好，我们一起去公园散步吧！",
    "这个小模型的参数是随机初始化的。",
    "请用开心的语气再说一遍这句话。",
    "我们在每一个片段都测量了延迟。",
    "二零二五年三月三日，火车早上七点出发。",
    "他说：“明天会下雨吗？”",
    "声音虽然很轻，但是意思非常清楚。",
    "流式合成可以一边生成一边播放音频。",
    "中文和English混合的句子也要能正确处理。",
    "请你说得慢一点，好吗？",
    "谢谢大家，我们下次再见。",
)


def train_tokenizer(out_dir: Path) -> None:
    """Byte-level BPE with Qwen2's pre-tokenisation (NFC, split regex), saved as vocab.json + merges.txt.

    The three Qwen2 specials are appended to vocab.json at their real ids so that the CosyVoice3 tokenizer,
    which adds its own specials after the highest existing id, gives them their real ids too.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS_EN + _CORPUS_ZH, trainer)
    tokenizer.model.save(str(out_dir))
    vocab_path = out_dir / "vocab.json"
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    vocab.update({token: FIRST_SPECIAL_ID + i for i, token in enumerate(QWEN_SPECIALS)})
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")


def qwen_files(d: TinyDims) -> dict[str, dict]:
    """config.json, generation_config.json and tokenizer_config.json as the released folder has them."""
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": FIRST_SPECIAL_ID,
        "eos_token_id": FIRST_SPECIAL_ID,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": d.layers,
        "model_type": "qwen2",
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN_VOCAB,
    }
    generation = {"_from_model_config": True, "bos_token_id": FIRST_SPECIAL_ID, "eos_token_id": FIRST_SPECIAL_ID,
                  "transformers_version": "4.51.3"}
    added = {str(FIRST_SPECIAL_ID + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True}
             for i, token in enumerate(QWEN_SPECIALS)}
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN_SPECIALS[1:]),
        "bos_token": None,
        "chat_template": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": QWEN_SPECIALS[0],
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": QWEN_SPECIALS[0],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return {"config.json": config, "generation_config.json": generation, "tokenizer_config.json": tokenizer_config}
