"""The one base the chapters stand on (plumbing, not chapters).

    runtime        GPU or simulator, arrays in and out, argument checks, event timing
    shared_memory  dynamic shared memory beyond 48 KB a block, and a launch that picks static or dynamic
    backward_tiles the backward's tile type (BackwardTiles), thread splits, shared layouts, checks
    backward_args  the backward's argument checks, device views, zero gradients, output buffers
    key_split      a forward's keys split among blocks where its grid is too small (and the merge)
    query_split    a backward's query tiles split among blocks where its grid is too small
    masks          the block mask (chapter 6's input type, shared with the oracle)
    fused          what the fused kernels of chapters 4, 5, 6 share: the tile type,
                   row reductions across a row's threads, run lengths, numeric constants
    io_model       the IO models of every chapter and the measured ceilings (from the committed results)
    testing        the tolerance rule, Hypothesis strategies, the exercise checker
    ptx_check      compiles every chapter's kernels for sm_90 (no GPU needed)
    sass           what ptxas makes of a kernel (registers, instructions, loops), read with no GPU
    gradient_adds  dQ's float32 atomic adds in the tensor-core backwards (pairs, and a warp's tiles)

The chapters themselves are the modules one level up (``kernels/flash_forward.py`` ...).
"""
