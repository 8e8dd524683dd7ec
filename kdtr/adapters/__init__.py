"""Server layouts: a kdtr Problem as a serving engine hands its tensors to attention, and back.

Numpy only, so a Python kernel written in a server's layout is verified and benched unchanged
(kdtr.kernels.python) and a server's buffers become a Problem for the golden reference.
"""
