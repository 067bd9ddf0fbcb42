"""BatchNormalization on TensorFlow's fused kernel (`FusedBatchNormV3`)."""

from __future__ import annotations

import keras
import tensorflow as tf

__all__ = ["FusedBatchNormalization"]


@keras.saving.register_keras_serializable(package="kvram")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` computed by one fused TensorFlow op.

    Keras 3 builds batch normalization from separate ops: under mixed precision
    it casts the activation to float32, reduces it twice (mean, then variance)
    and normalizes it in a third pass. TensorFlow's `FusedBatchNormV3` (cuDNN's
    batch norm on the GPU without XLA; one `batch-norm-training` instruction
    under XLA) reads the float16/bfloat16 activation directly, computes both
    statistics in one pass, and has a fused gradient. Same layer, same weights,
    same arguments and the same results within float rounding: the moving
    statistics are updated with Keras's formula from the biased batch variance.

    The fused op is used for 4-D inputs normalized over the last axis (NHWC
    convolution features) without a mask or `synchronized=True`; anything else
    falls back to Keras's implementation. `kvram.speed.fuse_batch_norm(model)`
    swaps every `BatchNormalization` of a built model for this layer.

    Args: those of `keras.layers.BatchNormalization`.
    """

    def _fusable(self, inputs, mask) -> bool:
        # Keras keeps `axis` as one int.
        return (
            mask is None and not self.synchronized and len(inputs.shape) == 4 and self.axis in (3, -1)
        )

    def call(self, inputs, training=None, mask=None):
        if not self._fusable(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        x = tf.convert_to_tensor(inputs)
        if x.dtype != self.compute_dtype:
            x = tf.cast(x, self.compute_dtype)
        channels = x.shape[-1]
        scale = self.gamma if self.scale else tf.ones([channels], "float32")
        offset = self.beta if self.center else tf.zeros([channels], "float32")
        scale = tf.cast(scale, "float32")
        offset = tf.cast(offset, "float32")
        if training and self.trainable:
            empty = tf.constant([], "float32")
            y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=scale, offset=offset, mean=empty, variance=empty,
                epsilon=self.epsilon, exponential_avg_factor=1.0,
                data_format="NHWC", is_training=True,
            )
            # The op returns the unbiased (Bessel-corrected) batch variance;
            # Keras's moving variance averages the biased one.
            count = tf.cast(tf.size(x) // channels, "float32")
            variance = variance * tf.maximum(count - 1.0, 0.0) / tf.maximum(count, 1.0)
            mean, variance = tf.stop_gradient(mean), tf.stop_gradient(variance)
            momentum = self.momentum
            self.moving_mean.assign(
                self.moving_mean * momentum + tf.cast(mean, self.moving_mean.dtype) * (1.0 - momentum)
            )
            self.moving_variance.assign(
                self.moving_variance * momentum
                + tf.cast(variance, self.moving_variance.dtype) * (1.0 - momentum)
            )
        else:
            y, _, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=scale, offset=offset,
                mean=tf.cast(self.moving_mean, "float32"),
                variance=tf.cast(self.moving_variance, "float32"),
                epsilon=self.epsilon, data_format="NHWC", is_training=False,
            )
        return y
