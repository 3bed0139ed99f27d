"""M2 of the GPU review: a first step that the fp16 GradScaler (or --skip-nonfinite) skipped must not
make the schedule warn, nor shift it: the lr stays a function of the step number."""
import warnings

import torch

from maskrcnn_tut.engine import advance_schedule, lr_schedule


def test_a_skipped_first_step_advances_the_schedule_without_a_warning():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(warmup_steps=4, total_steps=10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advance_schedule(scheduler)  # the optimizer did not step: GradScaler found inf gradients
        optimizer.step()
        advance_schedule(scheduler)
    assert optimizer.param_groups[0]["lr"] == 0.1 * lr_schedule(4, 10)(2)
