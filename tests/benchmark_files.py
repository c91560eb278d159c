"""Small benchmark files in the exact shapes of the public sets, written by the tests.

The public sets (AIME24/25, MATH-500, AMC23, GPQA-Diamond) are not part of the repository; these
rows carry what makes their files tricky: AIME24's zero-padded string answers, AIME25's integer
answers, MATH-500's LaTeX answers beside a worked solution, AMC23's float answers under
"question", GPQA's lettered options. The problems are our own.
"""

import json
import os

ROWS = {
    "aime24.jsonl": [
        {"id": 60, "problem": "Find the remainder when 1025 is divided by 1000.", "answer": "025",
         "url": "https://example.org/aime24/1", "solution": "It is $\\boxed{025}$."},
        {"id": 61, "problem": "What is 3 * 7 * 11?", "answer": "231", "url": "https://example.org/aime24/2",
         "solution": "$\\boxed{231}$"},
        {"id": 62, "problem": "How many positive divisors does 360 have?", "answer": "024",
         "url": "https://example.org/aime24/3", "solution": "$\\boxed{24}$"},
    ],
    "aime25.jsonl": [
        {"id": 0, "problem": "Find the sum of all positive divisors of 28.", "answer": 56},
        {"id": 1, "problem": "What is 2^10 modulo 1000?", "answer": 24},
    ],
    "math_500.jsonl": [
        {"problem": "Simplify $\\frac{6}{8}$.", "answer": "\\frac{3}{4}", "solution": "$\\boxed{\\frac34}$",
         "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
        {"problem": "Convert $(0,3)$ to polar coordinates.", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
         "solution": "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", "subject": "Precalculus", "level": 2,
         "unique_id": "test/precalculus/807.json"},
        {"problem": "Which option is right?", "answer": "\\text{(C)}", "solution": "$\\boxed{\\text{(C)}}$",
         "subject": "Algebra", "level": 3, "unique_id": "test/algebra/2.json"},
    ],
    "amc23.jsonl": [
        {"id": 0, "question": "What is 3 cubed?", "answer": 27.0, "url": "https://example.org/amc23/1"},
        {"id": 1, "question": "What is one half of 5?", "answer": 2.5, "url": "https://example.org/amc23/2"},
    ],
    "gpqa_diamond.jsonl": [
        {"question": "Which is a noble gas?\nA) Oxygen\nB) Neon\nC) Sodium\nD) Iron", "options": ["Oxygen", "Neon",
         "Sodium", "Iron"], "answer": "B", "correct_answer": "Neon"},
        {"question": "What is 2+2?\nA) 3\nB) 5\nC) 4\nD) 22", "options": ["3", "5", "4", "22"], "answer": "C",
         "correct_answer": "4"},
    ],
}


def write_benchmarks(directory) -> str:
    os.makedirs(directory, exist_ok=True)
    for name, rows in ROWS.items():
        with open(os.path.join(directory, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(directory)
