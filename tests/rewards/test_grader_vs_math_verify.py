"""Our grader never scores below math-verify alone: a table of answer pairs we wrote (units, text,
matrices, intervals, sets, complex numbers, percentages, degrees, multiple answers, numbers),
each labelled equivalent or not, scored by both; per category ours must be right at least as
often as math-verify's own parse + verify."""

import collections

import pytest
from math_verify import parse, verify

from rstar2_jax.rewards import is_equivalent

# (category, predicted, gold, equivalent)
PAIRS = [
    # units
    ("units", "10", "10 \\text{ cm}^2", True), ("units", "10 \\text{ cm}^2", "10", True),
    ("units", "864", "864 \\mbox{ inches}^2", True), ("units", "5.4", "5.4 \\text{ cents}", True),
    ("units", "12 \\text{ meters}", "12", True), ("units", "3\\text{ m}^3", "3", True),
    ("units", "7 \\text{ cm}", "8 \\text{ cm}", False), ("units", "20\\text{ km}", "2", False),
    # text
    ("text", "\\text{Navin}", "Navin", True), ("text", "Evelyn", "\\text{Evelyn}", True),
    ("text", "\\text{(C)}", "C", True), ("text", "\\textbf{(B)}", "(B)", True),
    ("text", "5 \\text{ apples}", "5", True), ("text", "\\text{yes}", "\\text{no}", False),
    ("text", "\\text{odd}", "\\text{even}", False), ("text", "x = 4 \\text{ or } x = -4", "\\pm 4", True),
    # matrices
    ("matrices", "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", True),
    ("matrices", "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
     "\\begin{bmatrix} \\frac{1}{5} \\\\ -\\frac{18}{5} \\end{bmatrix}", True),
    ("matrices", "\\begin{pmatrix}-2\\\\-14\\\\-7\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}", True),
    ("matrices", "\\begin{bmatrix} 0 & 1 \\\\ 1 & 0 \\end{bmatrix}", "\\begin{pmatrix} 0 & 1 \\\\ 1 & 0 \\end{pmatrix}", True),
    ("matrices", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}", False),
    ("matrices", "\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", False),
    # intervals
    ("intervals", "(-\\infty, 0]", "(-\\infty,0]", True), ("intervals", "[-2, 7]", "[-2,7]", True),
    ("intervals", "(2, \\infty)", "(2,\\infty)", True), ("intervals", "x \\in [-2,7]", "[-2,7]", True),
    ("intervals", "[-2, 7)", "[-2,7]", False), ("intervals", "(1, 3)", "[1, 3]", False),
    ("intervals", "(-\\infty, -1) \\cup (1, \\infty)", "(-\\infty,-1)\\cup(1,\\infty)", True),
    # sets
    ("sets", "\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True), ("sets", "\\{1,2\\}", "\\{1, 2\\}", True),
    ("sets", "\\{1, 2\\}", "\\{1, 3\\}", False), ("sets", "\\{-1, 1\\}", "\\{1, -1\\}", True),
    ("sets", "\\{2\\}", "\\{2, 3\\}", False),
    # complex numbers
    ("complex", "1+2i", "1 + 2i", True), ("complex", "2i+1", "1+2i", True),
    ("complex", "1 + 2\\mathrm{i}", "1+2i", True), ("complex", "-2 + 7i", "-2+7\\text{i}", True),
    ("complex", "6 - 5i", "6-5i", True), ("complex", "i\\sqrt{2}", "\\sqrt{2}i", True),
    ("complex", "3 + 4\\mathit{i}", "3+4i", True), ("complex", "1 - 12i", "1 + 12i", False),
    ("complex", "1+274i", "1+247i", False), ("complex", "2\\imath", "2i", True),
    # percentages
    ("percentages", "10\\%", "10", True), ("percentages", "50", "50\\%", True),
    ("percentages", "12.5\\%", "12.5", True), ("percentages", "25 \\%", "25\\%", True),
    ("percentages", "20\\%", "25\\%", False), ("percentages", "0.5\\%", "5", False),
    # degrees
    ("degrees", "30^\\circ", "30", True), ("degrees", "55", "55^\\circ", True),
    ("degrees", "76^{\\circ}", "76", True), ("degrees", "90°", "90^\\circ", True),
    ("degrees", "180^\\circ", "90^\\circ", False), ("degrees", "36 \\text{ degrees}", "36", True),
    # multiple answers
    ("multiple", "2, -2", "-2, 2", True), ("multiple", "1, 2, 3", "3, 2, 1", True),
    ("multiple", "5, 6, 7", "7", False), ("multiple", "1, 2", "1, 3", False),
    ("multiple", "x = 1, x = 2", "1, 2", True), ("multiple", "3", "3, 4", False),
    # numbers and forms (baseline categories)
    ("numbers", "025", "25", True), ("numbers", "10,080", "10080", True), ("numbers", "\\frac{1}{2}", "0.5", True),
    ("numbers", "\\$32,\\!348", "32348", True), ("numbers", "1\\frac{4}{5}", "\\frac{9}{5}", True),
    ("numbers", "0.333", "\\frac{1}{3}", False), ("numbers", "4343_6", "4343_6", True),
]


def math_verify_alone(pred: str, gold: str) -> bool:
    """math-verify as its README uses it: parse both (default extraction), verify(gold, pred)."""
    try:
        g, p = parse("$" + gold + "$"), parse("$" + pred + "$")
        return bool(g) and bool(p) and bool(verify(g, p))
    except BaseException:  # noqa: BLE001 - its TimeoutException derives from BaseException
        return False


@pytest.fixture(scope="module")
def scores():
    right = collections.defaultdict(lambda: {"pairs": 0, "math_verify": 0, "ours": 0})
    for category, pred, gold, equivalent in PAIRS:
        r = right[category]
        r["pairs"] += 1
        r["math_verify"] += math_verify_alone(pred, gold) == equivalent
        r["ours"] += is_equivalent(pred, gold) == equivalent
    return right


def test_the_table_covers_every_category_with_enough_pairs():
    categories = collections.Counter(c for c, *_ in PAIRS)
    assert len(PAIRS) >= 60
    assert set(categories) >= {"units", "text", "matrices", "intervals", "sets", "complex", "percentages", "degrees",
                               "multiple"}
    assert all(n >= 5 for n in categories.values()), categories
    assert all(any(eq for c2, *_, eq in PAIRS if c2 == c) and any(not eq for c2, *_, eq in PAIRS if c2 == c)
               for c in categories)  # both kinds in every category


@pytest.mark.parametrize("category", sorted({c for c, *_ in PAIRS}))
def test_ours_is_never_below_math_verify_alone(scores, category):
    r = scores[category]
    assert r["ours"] >= r["math_verify"], r


def test_ours_gets_every_pair_of_the_table_right():
    wrong = [(p, g, eq) for _, p, g, eq in PAIRS if is_equivalent(p, g) != eq]
    assert not wrong, wrong
