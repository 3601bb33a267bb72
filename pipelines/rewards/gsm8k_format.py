"""GSM8K reward for a model that does not yet answer in GSM8K's `#### N` format.

verl's strict GSM8K rule gives Qwen2.5-Coder-0.5B-Instruct almost no signal (it answers with
`\\boxed{N}`: 0% strict, ~25% last-number accuracy), so GRPO would see all-zero groups. This rule
pays for the right number whatever the format, and more for the right number in the format
(verl's two extraction rules, on the last 300 characters as verl clips):

    1.0  `#### N` present and its last N is right        (verl strict)
    0.5  no `#### N`, the last number of the text is right (verl flexible)
    0.1  `#### N` present but wrong                      (format only)
    0.0  otherwise

Use with `score --reward python:pipelines/rewards/gsm8k_format.py`; score >= 1 (accuracy in the
summaries) is then the strict accuracy. Rescore with `--reward gsm8k --gsm8k-method flexible`
for the last-number accuracy.
"""

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str[-300:]
    truth = str(ground_truth)
    strict = _STRICT.findall(text)
    if strict:
        answer = strict[-1].replace(",", "").replace("$", "")
        return 1.0 if answer == truth else 0.1
    numbers = [n for n in _NUMBER.findall(text) if n not in ("", ".")]
    if numbers and numbers[-1] == truth:
        return 0.5
    return 0.0
