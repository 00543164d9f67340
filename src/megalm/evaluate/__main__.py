from megalm.evaluate import main

main()
