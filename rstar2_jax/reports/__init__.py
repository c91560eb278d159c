"""Results read back for people: benchmark scores (eval_report.py) and an ablation's runs
(ablation.py)."""
