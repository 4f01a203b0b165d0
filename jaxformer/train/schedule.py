"""Learning-rate schedules: the paper's rsqrt warm-up and two alternatives."""
import math
from collections.abc import Sequence

import jax.numpy as jnp
import ml_collections
import optax


def paper_schedule(d_model: int, warmup_steps: int,
                   factor: float = 1.0) -> optax.Schedule:
  """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with
  steps counted from 1."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return factor * d_model ** -0.5 * jnp.minimum(
        step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def warmup_rsqrt_schedule(peak: float, warmup_steps: int) -> optax.Schedule:
  """Linear warm-up to `peak`, then peak * sqrt(warmup / step)."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return peak * jnp.minimum(step / warmup_steps,
                              jnp.sqrt(warmup_steps / step))
  return schedule


def warmup_cosine_schedule(peak: float, warmup_steps: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warm-up to `peak`, cosine decay to 0 at `total_steps`."""
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps, max(total_steps, warmup_steps + 1))


def decay_segments(plan: Sequence[tuple[int, int]]
                   ) -> list[tuple[int, float, int]]:
  """(start step, decay progress there, end step) of each part of a plan
  ((step, num_steps), ...): the cosine decay runs from plan[0]'s step to its
  num_steps; each later pair stretches or shrinks the decay's remaining part
  to end at its num_steps instead (pairs that keep the end are no-ops)."""
  start, end = plan[0]
  segments = [(start, 0.0, end)]
  for step, num_steps in plan[1:]:
    if num_steps == end:
      continue
    progress = decay_progress(segments, step)
    segments.append((step, progress, num_steps))
    end = num_steps
  return segments


def decay_progress(segments: Sequence[tuple[int, float, int]],
                   step: int) -> float:
  """The decay's progress (0 to 1) at `step` of `decay_segments`."""
  start, progress, end = [s for s in segments if s[0] <= step][-1]
  return progress + (1 - progress) * min(step - start, end - start) / max(
      end - start, 1)


def replanned_cosine_schedule(peak: float, warmup_steps: int,
                              plan: Sequence[tuple[int, int]]
                              ) -> optax.Schedule:
  """Linear warm-up to `peak`, then cosine decay to 0 over the parts of
  `plan` (`decay_segments`): a function of the step and the plan alone."""
  segments = decay_segments(plan)
  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    progress = jnp.zeros_like(step)
    for start, done, end in segments:
      part = jnp.minimum(step - start, end - start) / max(end - start, 1)
      progress = jnp.where(step >= start, done + (1 - done) * part, progress)
    decayed = 0.5 * peak * (1 + jnp.cos(math.pi * progress))
    return jnp.where(step < warmup_steps, peak * step / warmup_steps, decayed)
  return schedule


def make_schedule(train: ml_collections.ConfigDict, d_model: int,
                  plan: Sequence[tuple[int, int]] = ()) -> optax.Schedule:
  """The schedule of `train.schedule`; `plan` (`replanned_cosine_schedule`,
  from `train.schedule_over_budget`) decides where warmup_cosine decays."""
  if plan:
    return replanned_cosine_schedule(train.learning_rate, train.warmup_steps,
                                     plan)
  if train.schedule == 'rsqrt':
    return paper_schedule(d_model, train.warmup_steps, train.learning_rate)
  if train.schedule == 'warmup_rsqrt':
    return warmup_rsqrt_schedule(train.learning_rate, train.warmup_steps)
  if train.schedule == 'warmup_cosine':
    return warmup_cosine_schedule(train.learning_rate, train.warmup_steps,
                                  train.num_steps)
  raise ValueError(f"train.schedule={train.schedule!r} is not one of "
                   "'rsqrt', 'warmup_rsqrt', 'warmup_cosine'.")


def make_optimizer(train: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """Adam(W) with the paper's betas, after clipping by global norm."""
  parts = []
  if train.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(train.grad_clip_norm))
  if train.weight_decay:
    parts.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                             weight_decay=train.weight_decay))
  else:
    parts.append(optax.adam(schedule, b1=train.b1, b2=train.b2, eps=train.eps))
  return optax.chain(*parts)
