"""Device-specific expert kernels behind one seam each (``moe.experts_impl``); the
accelerator path is plain torch (``epscale.moe.experts``)."""
