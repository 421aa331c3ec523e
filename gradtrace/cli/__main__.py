"""``python -m gradtrace.cli``: the same as the ``gradtrace`` command."""

from .main import main

if __name__ == "__main__":
    main()
