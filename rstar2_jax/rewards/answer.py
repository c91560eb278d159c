"""Answer extraction and the normalisation that math-verify does not do for us."""

from __future__ import annotations

import re

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None  # unbalanced: no answer


def extract_answer(response: str) -> str | None:
    """The \\boxed{} answer inside the last <answer>...</answer> block of a response, or None."""
    blocks = _ANSWER_BLOCK.findall(response)
    if not blocks:
        return None
    return last_boxed(blocks[-1])


_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathit|mbox|mathbf|operatorname)\{([^{}]*)\}")
# A number followed by words in a text box, optionally squared or cubed ("10 \text{ cm}^2",
# "5 \text{ apples}"): the words are a unit or a label, the number is the answer.
_TRAILING_TEXT = re.compile(r"^(.*?\d)\s*\\(?:text|mbox|mathrm|textrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?\s*$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNITS = re.compile(r"\s*\\?(?:text\{)?\s*(?:cm|m|km|kg|g|mg|s|sec|seconds|minutes|hours|units|degrees|dollars|"
                    r"inches|feet|ft|meters|cents|square units|sq units)\s*\}?(?:\^\{?\d\}?)?\s*$")
_LATEX_SPACE = re.compile(r"(?<!\\)\\ ")  # "\ " (a space), not the row break "\\" followed by a space
_IMAGINARY_UNIT = re.compile(r"\\imath\b|\\(?:mathrm|mathit|text|operatorname)\{i\}")
_CHOICE = re.compile(r"^\(?\s*([A-Ea-e])\s*\)?$")


def normalize(answer: str) -> str:
    """A canonical string for answers that should compare equal textually."""
    s = answer.strip().strip("$").strip()
    if s.startswith("\\boxed"):
        s = last_boxed(s) or s
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = _LATEX_SPACE.sub(" ", s)
    s = s.replace("{bmatrix}", "{pmatrix}")  # the same matrix, square or round brackets
    s = _IMAGINARY_UNIT.sub("i", s)
    s = _TRAILING_TEXT.sub(r"\1", s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = _UNITS.sub("", s)
    s = _THOUSANDS.sub("", s)
    s = s.rstrip(".").strip()
    if re.fullmatch(r"[+-]?0*\d+", s):  # integers with leading zeros: 007 -> 7
        sign = "-" if s.startswith("-") else ""
        s = sign + (s.lstrip("+-").lstrip("0") or "0")
    return " ".join(s.split())


def choice_letter(answer: str) -> str | None:
    """'B' for 'B', '(B)', '\\text{(B)}'; None for anything that is not a lone choice letter."""
    m = _CHOICE.match(normalize(answer))
    return m.group(1).upper() if m else None


_CHOICE_LEAD = re.compile(r"^(?:(?:option|answer|choice)\s*:?\s*)?\(?([A-Ja-j])\)?(?=$|[\s.:)\]])", re.IGNORECASE)


def chosen_option(answer: str) -> str | None:
    """The option letter a multiple-choice answer picks: 'D' for 'D', '(D)', 'D.', 'D) 10^-4 eV',
    'Option D', '\\text{D}'; None when it does not start with a lone letter ('Dopamine')."""
    m = _CHOICE_LEAD.match(normalize(answer))
    return m.group(1).upper() if m else None


def top_level_items(answer: str) -> int:
    """How many comma-separated items an answer lists outside brackets ('5, 6, 7' -> 3)."""
    s = _THOUSANDS.sub("", answer)
    depth, items = 0, 1
    for ch in s:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            items += 1
    return items
