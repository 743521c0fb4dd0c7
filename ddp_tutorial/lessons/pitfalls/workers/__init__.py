"""Worker scripts of lesson 08 (one per pitfall, and the lab that runs six in one launch)."""
