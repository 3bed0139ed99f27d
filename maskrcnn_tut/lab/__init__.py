"""The lab behind the book: what the chapters measure and show, on the reader's hardware.

It imports the training core (`maskrcnn_tut`); the core never imports it (tests/test_layers.py).

- `bench/`: the speed table, one sweep per technique, the fast path, the loop's overhead, time to
  accuracy, COCO-scale start-up, scaling on paper, the GPU suite.
- `stored/`: what a measurement keeps and for how long: `result` (`BenchResult`, with provenance),
  `across_builds` (`cached`: each benchmark once per hardware and code, on disk) and `within_build`
  (`once`: each figure once per build, which the Japanese chapters read back).
- `processes`: `launch(fn, n)`, small process groups started from a notebook cell.
- `provenance`: this machine and its software in words, as every results file records them, and
  chapter 2's environment report (the facts underneath are the core's `hardware`).
- `nvml`: the GPUs through NVML (one reader), a sampler thread, their health; `device_memory`: memory
  in use, the device's total, a new peak; `health`: the article's healthy ranges as advice.
- `speed_findings`, `scale_findings`, `machine_findings`: the figures and verdicts the chapters print,
  and the sentences true of this machine.
- `memory`, `timeline`: where memory goes, memory over one step, the input-shape census.
- `traces`, `diagrams`: a profiled DDP step; DP/DDP and the ring all-reduce drawn from code.
- `proofs`: exact checks the chapters assert (accumulation equals a large batch, DDP + no_sync,
  gradient noise, first batches with and without set_epoch).
- `article`: the article's own code and stack, run as written; `minimal_ddp`: its training code corrected,
  one whole DDP script (chapter 4 shows and runs it); `preflight`: checks before
  distributed work on a hub, a stalled rank diagnosed; `dataparallel`: DataParallel for detection
  lists; `synthetic`: synthetic batches.
- `book`, `dashboard`: the chapters' display helpers and the live training view.
- `wording` (with `prose/`), `book_fonts`: the two editions' words and the Japanese pages' font.
"""
