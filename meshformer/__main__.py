from meshformer.cli import main

main()
