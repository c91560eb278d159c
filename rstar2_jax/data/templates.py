"""Public problem sets' own instruction templates, recognised exactly, so that a run chooses whose
instructions the policy reads (`data.problems.instructions`) instead of getting both by accident.

A public RL set often stores each problem inside its own instructions (DAPO-Math-17k asks for a
last line `Answer: ...`, verl's MATH preprocessing for a \\boxed{}), while our prompt format wraps
the text again in ours (`<answer>\\boxed{...}</answer>`). With `instructions=strip` a recognised
template is taken off and only our format instructs; with `keep` the text stays as it is and the
run should grade the format that template asks for (`data.answer_format`; the config check warns
when it does not). A text whose template is not recognised is left as it is, and counted.

Each template is the exact text its source writes around a problem (`prefix + problem + suffix`):

    dapo_math_17k  BytedTsinghua-SIA/DAPO-Math-17k, `prompt[0].content` of every row (the strings as
                   the dataset has them; the same in open-r1's DAPO-Math-17k-Processed `source_prompt`)
    verl_gsm8k     verl examples/data_preprocess/gsm8k.py: question + " " + instruction_following
    verl_math      verl examples/data_preprocess/math_dataset.py: question + " " + instruction_following
    open_r1        open-r1's README, "Generate data from a smol distilled R1 model" (prompt_template,
                   how its R1 traces were made)
    rstar2_agent   rStar2-Agent's user template (rstar2_agent/config, rollout/prompt.py DEFAULT_USER)
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from rstar2_jax.core.registry import Registry
from rstar2_jax.rewards.answer_formats import ANSWER_FORMATS


@dataclasses.dataclass(frozen=True)
class Template:
    prefix: str
    suffix: str
    answer_format: str   # the answer format its instructions ask for (rewards/answer_formats.py)

    def strip(self, text: str) -> str | None:
        """The problem inside `text`, if `text` is exactly this template around one; else None."""
        if len(text) > len(self.prefix) + len(self.suffix) and text.startswith(self.prefix) \
                and text.endswith(self.suffix):
            return text[len(self.prefix):len(text) - len(self.suffix)]
        return None


TEMPLATES: Registry[Template] = Registry("problem template")
TEMPLATES.register("dapo_math_17k", Template(
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
    '\n\nRemember to put your answer on its own line after "Answer:".', "dapo"))
TEMPLATES.register("verl_gsm8k", Template("", ' Let\'s think step by step and output the final answer after "####".',
                                          "gsm8k"))
TEMPLATES.register("verl_math", Template("", " Let's think step by step and output the final answer within \\boxed{}.",
                                         "boxed"))
TEMPLATES.register("open_r1", Template(
    "You will be given a problem. Please reason step by step, and put your final answer within \\boxed{}:\n", "",
    "boxed"))
TEMPLATES.register("rstar2_agent", Template(
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your final "
    "answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n", "", "answer_boxed"))

INSTRUCTIONS = ("strip", "keep")


def recognise(text: str) -> tuple[str | None, str]:
    """(the template's name, the problem without it), or (None, text) when no template fits."""
    for name, template in TEMPLATES.items():
        problem = template.strip(text)
        if problem is not None:
            return name, problem
    return None, text


@dataclasses.dataclass(frozen=True)
class TemplateCount:
    """What a set's texts held: rows per recognised template, and rows with none recognised."""
    templates: dict[str, int]
    unrecognised: int

    @classmethod
    def of(cls, texts: Iterable[str]) -> "TemplateCount":
        counts: dict[str, int] = {}
        unrecognised = 0
        for text in texts:
            name, _ = recognise(text)
            if name is None:
                unrecognised += 1
            else:
                counts[name] = counts.get(name, 0) + 1
        return cls(counts, unrecognised)

    def describe(self) -> str:
        found = ", ".join(f"{n} rows in {name}'s template" for name, n in sorted(self.templates.items()))
        return f"{found or 'no known template'}; {self.unrecognised} rows with none recognised (left as they are)"


@dataclasses.dataclass(frozen=True)
class Fixes:
    """How a command line sets what a warning suggests ({} is the value), train's or evaluate's."""
    answer_format: str = "--config.data.answer_format={}"
    strip: str = "--config.data.problems.instructions=strip"
    prompt_format: str = "--config.format={}"
    keeping: str = "data.problems.instructions=keep"     # how the warning names the settings in force
    grading: str = "data.answer_format={!r}"


def kept_template_warnings(names: Iterable[str], where: str, graded: str, prompt_format: str,
                           prompt_asks: str, fixes: Fixes = Fixes()) -> list[str]:
    """Warnings for a set that keeps the recognised templates `names` (instructions=keep): a
    template that asks for another answer format than the one graded (`graded`: a response that
    follows the set scores 0), and one that asks for another than the prompt format's own
    instructions (`prompt_asks`, '' for a format that gives none: the model reads two conflicting
    answer instructions)."""
    out = []
    for name in sorted(set(names)):
        asks = TEMPLATES[name].answer_format
        if asks != graded:
            out.append(f"{fixes.keeping} keeps {name}'s template in {where} (it asks for "
                       f"{ANSWER_FORMATS[asks].asks}: answer format {asks!r}) while {fixes.grading.format(graded)} "
                       f"grades {ANSWER_FORMATS[graded].asks}: a response that follows the set scores 0. Set "
                       f"{fixes.answer_format.format(asks)} or {fixes.strip}")
        if prompt_asks and prompt_asks != asks:
            out.append(f"{fixes.keeping} keeps {name}'s template in {where} (it asks for "
                       f"{ANSWER_FORMATS[asks].asks}) inside the prompt format {prompt_format!r}, whose own "
                       f"instructions ask for {ANSWER_FORMATS[prompt_asks].asks}: the model reads two conflicting "
                       f"answer instructions. Set {fixes.strip} (only the prompt format instructs; grade "
                       f"{prompt_asks!r}) or a prompt format without answer instructions "
                       f"({fixes.prompt_format.format('tiny')})")
    return out


def apply_instructions(text: str, instructions: str) -> str:
    """The problem text the policy reads: `strip` takes a recognised template off, `keep` keeps it."""
    if instructions not in INSTRUCTIONS:
        raise ValueError(f"instructions must be one of {INSTRUCTIONS}, got {instructions!r}")
    return recognise(text)[1] if instructions == "strip" else text
