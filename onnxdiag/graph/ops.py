"""Op categories shared by layer listing and channel grouping."""

from __future__ import annotations

#: Element-wise activations (one output value per input value, channels untouched).
ACTIVATIONS = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu",
    "Selu", "Celu", "Softplus", "Softsign", "Gelu", "Mish", "ThresholdedRelu", "Swish",
})

#: Unary ops that keep channel c of their input as channel c of their output
#: (per-channel parameters, if any, are listed in PER_CHANNEL_PARAMS).
CHANNEL_PRESERVING = ACTIVATIONS | frozenset({
    "BatchNormalization", "InstanceNormalization", "Dropout", "Identity", "Cast",
    "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
    "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Floor", "Ceil", "Round", "Sign",
    "Sin", "Cos", "Resize", "Upsample",
})

#: Inputs (by index) holding one value per channel, with the axis that indexes channels.
PER_CHANNEL_PARAMS = {
    "BatchNormalization": (1, 2, 3, 4),
    "InstanceNormalization": (1, 2),
}

#: Ops a BN may sit behind and still normalise a single conv's channels ("before_next").
BN_LOOKAHEAD = ACTIVATIONS | frozenset({
    "Dropout", "Identity", "MaxPool", "AveragePool", "Pad",
})

#: Element-wise ops between tensors that tie channel c of every operand together.
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Pow"})

#: Reductions that keep the channel axis when it is not among their axes.
REDUCTIONS = frozenset({"ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceL1",
                        "ReduceL2", "ReduceLogSumExp", "ReduceProd", "ReduceSumSquare"})

#: Ops that read only a tensor's shape, never its values.
SHAPE_ONLY = frozenset({"Shape", "Size"})
