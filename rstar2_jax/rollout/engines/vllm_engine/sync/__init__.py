"""The learner's weights into vLLM servers: exported (export.py), sent or fetched (push.py,
pull.py, nccl_group.py, adapters.py for LoRA), checked (probe.py, report.py) and, with several
learner processes, synced in the background over one shared export (background.py,
shared_export.py)."""
