"""How closely nanoflex's bfloat16 path follows transformers' bfloat16 run on the default model.

    python -m bench.quality.bf16_agreement [--max-tokens 40] [--json OUT]

nanoflex generates greedily in bfloat16 for the chat prompts of the trained-model tests
(tests/engine/chats.py); transformers' LlamaForCausalLM in bfloat16, fed prompt + our
tokens in one forward (teacher-forced), gives its argmax at every output position. The
figure is the share of positions where the two agree, and where they do not, how far
apart transformers' own top two logits were (a near-tie that bfloat16 rounding can flip
either way). float32 is exact (tests hold it token for token); bfloat16 cannot be, since
the two engines add in different orders and round to 8 bits of mantissa in between.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from engine.core.tokenizer import Tokenizer
from engine.loading.generated import local_model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tests.engine.chats import CHATS

    model_dir = local_model_dir(None)
    prompts = [Tokenizer(model_dir).apply_chat_template(chat) for chat in CHATS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with LLM(None, dtype="bfloat16") as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    agree = total = 0
    gaps: list[float] = []
    for prompt, tokens in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        top2 = rows.topk(2, dim=-1).values
        for i, token in enumerate(tokens):
            total += 1
            if int(rows[i].argmax()) == token:
                agree += 1
            else:
                gaps.append(float(top2[i, 0] - rows[i, token]))
    result: dict[str, Any] = {
        "positions": total,
        "agree": agree,
        "share": agree / total,
        "disagreement_logit_gaps": gaps,
    }
    table = Table(
        ["positions", "argmax agrees", "where not: reference margin over our token (max)"]
    )
    table.rows.append(
        [str(total), f"{100 * agree / total:.1f}%", f"{max(gaps):.3f}" if gaps else "-"]
    )
    print(table.markdown("rrr"))
    write_json(args.json, [result], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
