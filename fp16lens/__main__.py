from fp16lens.cli import main

raise SystemExit(main())
