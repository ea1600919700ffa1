"""Torch -> forward program: the TorchScript export (``torchscript.py``) and the guard it and
``torch.export`` trace under (``guard.py``), the traced program's hash and checks
(``program.py``), the operator record a cache hit is found by (``op_record.py``), and the rules a
batch is checked against (``input_checks.py``)."""
