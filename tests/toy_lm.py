"""A toy CosyVoice3LM for the LLM and scheduler tests: random weights, speech tokens likelier than stop ids."""

from __future__ import annotations

import torch

from cosyvoice.config import LLMConfig, QwenConfig
from cosyvoice.llm import CosyVoice3LM

EOP = 290  # <|endofprompt|> of the toy vocabulary
SPEECH = 40  # toy speech_token_size


def toy_lm() -> CosyVoice3LM:
    torch.manual_seed(0)
    qwen = QwenConfig(vocab_size=300, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0)
    model = CosyVoice3LM(LLMConfig(llm_input_size=16, llm_output_size=16, speech_token_size=SPEECH, qwen=qwen),
                         endofprompt_id=EOP)
    with torch.no_grad():  # like the golden bundle: speech tokens likelier than the 200 stop ids, so utterances run
        model.llm_decoder.weight[:SPEECH] *= 10.0
        model.llm_decoder.weight[SPEECH:] = 0.0
    return model.eval()
