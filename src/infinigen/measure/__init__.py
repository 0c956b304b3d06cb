"""What calibration measures and the evaluation reuses, through an attached session.

forced.py runs S teacher-forced tokens through any policy in one forward pass; recall.py is the
attention-recall observer; metrics.py compares a policy's logits with dense ones; spread_choice.py
is the measurement by which calibration chooses the budget's spread and the correction target.
Nothing here calibrates or attaches: it works on a session someone else made, so both the
calibration step and the evaluation can use it without importing each other.
"""
