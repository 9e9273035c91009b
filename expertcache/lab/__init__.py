"""The instruments: the emulation study and its report, the timed benchmark, traces and
the simulator, the cost model, calibration and the predictors' training and quality."""
