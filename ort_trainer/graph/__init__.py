"""The graph package: model -> forward program -> training graphs (forward, loss, backward) and
eval graphs, cached, and the optimizer graph.

Stages, lowest first (``docs/architecture.md``): ``names``, ``onnx_graph``, ``cache``, ``job``
(shared), ``export/``, ``passes/``, ``gradient/``, ``optimizer``, ``pipeline``, ``shapes``.
"""
