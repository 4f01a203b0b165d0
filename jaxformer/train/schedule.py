"""Learning-rate schedules: the paper's rsqrt warm-up and two alternatives."""
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


def make_schedule(train: ml_collections.ConfigDict,
                  d_model: int) -> optax.Schedule:
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
