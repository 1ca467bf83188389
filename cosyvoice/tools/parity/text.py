"""Parity of the text frontend: normalisation, splitting, token ids and prompt conventions.

Sources: ``text_frontend.json`` (per-case official ``text_normalize`` outputs, raw wetext output and
tokenizer ids, the special-token table, decode examples), ``frontend.safetensors`` (``zs_text`` /
``zs_prompt_text`` token ids) and the manifest's zero-shot scalars and ``_config`` texts. Everything
is compared exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, user_text, zero_shot_prompt_text
from cosyvoice.frontend.text import TextFrontend, default_normalizer, language_branch
from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer
from cosyvoice.tools.parity.common import Golden, Result, compare_exact

COMPONENT = "text"


def check(golden: Golden) -> list[Result]:
    tokenizer = CosyVoice3Tokenizer.from_model_dir(golden.bundle_dir)
    frontend = TextFrontend(tokenizer)
    results: list[Result] = []
    if golden.has("text_frontend.json"):
        results += _check_cases(golden.json("text_frontend.json"), tokenizer, frontend)
    if golden.has("frontend.safetensors"):
        results += _check_zero_shot(golden, tokenizer, frontend)
    results += _check_prompt_conventions(golden.manifest.get("_config", {}))
    return results


def _check_cases(fixture: dict[str, Any], tokenizer: CosyVoice3Tokenizer, frontend: TextFrontend) -> list[Result]:
    results = []
    specials = fixture.get("special_token_ids", {})
    if specials:
        wrong = [tok for tok, ids in specials.items() if tokenizer.encode(tok) != ids]
        results.append(Result(COMPONENT, "special_token_ids", float(len(wrong)), len(wrong) / len(specials), 0.0,
                              not wrong, f"{len(specials)} tokens" + (f", wrong: {wrong[:5]}" if wrong else "")))
    for i, example in enumerate(fixture.get("decode_examples", [])):
        results.append(compare_exact(COMPONENT, f"decode_examples[{i}]", tokenizer.decode(example["ids"]),
                                     example["decoded"]))
    for i, case in enumerate(fixture["cases"]):
        text = case["input"]
        name = f"case{i:02d}"
        split_true = frontend.split(text)
        split_false = frontend.normalize(text)
        # The fixture writes "skipped (contains <|...|>)"; its first word is the branch name.
        results.append(compare_exact(COMPONENT, f"{name}/lang_branch", language_branch(text),
                                     case["lang_branch"].split()[0]))
        if case["wetext_output"] is not None:
            raw = default_normalizer().normalize(text.strip())  # text_normalize strips before normalising
            results.append(compare_exact(COMPONENT, f"{name}/wetext_output", raw, case["wetext_output"]))
        results += [
            compare_exact(COMPONENT, f"{name}/split_true", split_true, case["split_true"]),
            compare_exact(COMPONENT, f"{name}/split_false", split_false, case["split_false"]),
            compare_exact(COMPONENT, f"{name}/raw_token_ids", tokenizer.encode(text), case["raw_token_ids"]),
            compare_exact(COMPONENT, f"{name}/split_true_token_ids", [tokenizer.encode(s) for s in split_true],
                          case["split_true_token_ids"]),
            compare_exact(COMPONENT, f"{name}/split_false_token_ids", tokenizer.encode(split_false),
                          case["split_false_token_ids"]),
        ]
    return results


def _check_zero_shot(golden: Golden, tokenizer: CosyVoice3Tokenizer, frontend: TextFrontend) -> list[Result]:
    """The zero-shot text inputs: normalise the configured texts as inference does, then tokenize."""
    arrays = golden.arrays("frontend.safetensors")
    config = golden.manifest.get("_config", {})
    tts_ref = golden.scalar("frontend.safetensors", "zs_tts_text_normalized")
    prompt_ref = golden.scalar("frontend.safetensors", "zs_prompt_text_normalized")
    results = []
    if "tts_text" in config:
        # Inference synthesises split pieces; the fixture's frontend call received the first one.
        pieces = frontend.split(config["tts_text"])
        results.append(compare_exact(COMPONENT, "zs_tts_text_normalized", pieces[0] if pieces else "", tts_ref))
    if "prompt_text" in config:
        results.append(compare_exact(COMPONENT, "zs_prompt_text_normalized", frontend.normalize(config["prompt_text"]),
                                     prompt_ref))
    results += [
        compare_exact(COMPONENT, "zs_text", np.asarray([tokenizer.encode(tts_ref)], dtype=np.int64),
                      arrays["zs_text"].astype(np.int64)),
        compare_exact(COMPONENT, "zs_prompt_text", np.asarray([tokenizer.encode(prompt_ref)], dtype=np.int64),
                      arrays["zs_prompt_text"].astype(np.int64)),
    ]
    return results


def _check_prompt_conventions(config: dict[str, Any]) -> list[Result]:
    """Our prompt helpers rebuild the official prompt strings from the plain user text."""
    builders = {"prompt_text": zero_shot_prompt_text, "crosslingual_text": cross_lingual_text,
                "instruct_text": instruct_text}
    return [compare_exact(COMPONENT, f"prompts/{key}", build(user_text(config[key])), config[key])
            for key, build in builders.items() if key in config]
