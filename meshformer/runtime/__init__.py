"""What runs inside every training process besides the loop: process groups and the job's device
(distributed.py), hang reports (watchdog.py), straggler metrics (stragglers.py) and the step profiler."""
