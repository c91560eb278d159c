"""SCALING.md's what-fits-where table is the memory plan's own output (issue 80 item 2: the
document said 58.7 GiB a device for the 14B recipe where `train --plan` gave 65.49)."""

import os
import re

from experiments.benchmarks.scaling_table import table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scaling_md_holds_the_table_the_plan_makes():
    text = open(os.path.join(ROOT, "SCALING.md")).read()
    found = re.search(r"<!-- scaling_table: generated, do not edit by hand -->\n(.*?)\n<!-- /scaling_table -->",
                      text, re.DOTALL)
    assert found, "SCALING.md lost its generated table's markers"
    assert found.group(1) == table(), "regenerate it: python -m experiments.benchmarks.scaling_table"
