"""User code the docs show, written as a training script would, for ``mypy --strict``.

Nothing here runs: ``tests/test_user_typing.py`` and ``nox -s typecheck`` type-check it. A
``# type: ignore[...]`` marks documented misuse a type checker must catch (``--strict`` warns
about an ignore that is no longer needed); ``assert_type`` pins the types users rely on.
"""
