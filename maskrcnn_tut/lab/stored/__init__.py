"""What the lab keeps of a measurement, and for how long.

- `result`: `BenchResult`, what one benchmark measured (rows, notes, provenance), its table, plots
  and file; the files of the GPU suite (`results_path`, `load_suite`).
- `across_builds`: `cached(fn, **args)`, each benchmark measured once per hardware, code and
  arguments and kept on disk with its spread, so every chapter and every rebuild quotes one
  measurement (`$MASKRCNN_TUT_CACHE/bench/`).
- `within_build`: `once(fn, ...)`, each figure measured once per build of the book, so the Japanese
  chapters show what the English ones measured; a Sphinx extension (`_config.yml`) and a pytest
  session (tests/conftest.py) start the build's session.
"""
